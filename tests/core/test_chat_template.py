"""A recipe's chat_template: built-in names render as mergekit's templates of the same
name render; literal Jinja and auto; a bad value is refused naming the field."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

import pytest

from maec_core.errors import RecipeError
from maec_core.parsing import parse_recipe
from maec_core.recipe.chat_template import NAMED, resolve_chat_template, with_chat_template
from tests.factories import tiny_tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": " Hi there "}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Add 2 and 3."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}],
]


def _render(template: str, messages: list[dict[str, str]], prompt: bool) -> str:
    tok = tiny_tokenizer()
    tok.chat_template = template
    return str(tok.apply_chat_template(messages, tokenize=False,
                                       add_generation_prompt=prompt))


@pytest.mark.parametrize("name", sorted(NAMED))
@pytest.mark.parametrize("prompt", [False, True])
def test_named_templates_render_as_mergekits(name: str, prompt: bool) -> None:
    data = pytest.importorskip("mergekit._data.chat_templates")
    theirs = resources.files(data).joinpath(f"{name}.jinja").read_text()
    for messages in CONVERSATIONS:
        assert _render(NAMED[name], messages, prompt) == _render(theirs, messages, prompt)


def test_recipe_values() -> None:
    base = {"merge_method": "linear", "models": [{"model": "a"}]}
    for ok in ("chatml", "auto", "{{ messages[0]['content'] }}"):
        assert parse_recipe({**base, "chat_template": ok}).chat_template == ok
    for bad, why in (("chatmll", "neither"), ("alpaca", "not built in"), ("{x}", "neither")):
        with pytest.raises(RecipeError, match=why) as err:
            parse_recipe({**base, "chat_template": bad})
        assert "chat_template" in str(err.value)


def test_auto_takes_the_most_common_template(tmp_path: Path) -> None:
    folders = []
    for i, template in enumerate(["{{ 'a' }}", "{{ 'b' }}", "{{ 'b' }}", None]):
        folder = tmp_path / str(i)
        folder.mkdir()
        if template is not None:
            (folder / "chat_template.jinja").write_text(template)
        folders.append(folder)
    assert resolve_chat_template("auto", folders) == "{{ 'b' }}"
    assert resolve_chat_template("auto", folders[3:]) is None
    assert resolve_chat_template("chatml", []) == NAMED["chatml"]


def test_the_template_replaces_one_in_the_tokenizer_config() -> None:
    files = {"tokenizer_config.json": b'{"chat_template": "old", "x": 1}'}
    out = with_chat_template(files, "new {{ x }}")
    assert out["chat_template.jinja"] == b"new {{ x }}"
    assert b"old" not in out["tokenizer_config.json"] and b'"x": 1' in out[
        "tokenizer_config.json"]
