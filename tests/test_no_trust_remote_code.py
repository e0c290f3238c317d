"""``trust_remote_code`` is never set: a static scan of the code and a runtime check.

The scan parses every .py file of the shipped and experiment code and flags any call,
dict or assignment that sets ``trust_remote_code`` to anything but the literal False,
and any ``**kwargs`` splat into a ``from_pretrained`` call (it could carry the flag
through). The runtime check wraps transformers' ``from_pretrained`` entry points while
the gradient pass loads a checkpoint whose folder carries remote code that would leave a
marker file if it ever ran.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("maec_core", "app", "worker", "maec_client", "experiments", "bench")
FLAG = "trust_remote_code"
RAW = re.compile(r"""trust_remote_code["']?\s*[=:](?!\s*False\b)""")

pytestmark = pytest.mark.faults


def _is_false(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is False


def scan_source(source: str, name: str = "<src>") -> list[str]:
    """Every place in ``source`` that could set trust_remote_code to something truthy."""
    problems: list[str] = []
    tree = ast.parse(source, filename=name)
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call):
            func = node.func
            fname = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            for kw in node.keywords:
                if kw.arg == FLAG and not _is_false(kw.value):
                    problems.append(f"{where}: {FLAG}={ast.unparse(kw.value)}")
                if kw.arg is None and fname == "from_pretrained":
                    problems.append(f"{where}: **{ast.unparse(kw.value)} into from_pretrained")
            if fname == "setattr" and len(node.args) >= 3:
                attr_name, value = node.args[1], node.args[2]
                named = isinstance(attr_name, ast.Constant) and attr_name.value == FLAG
                if named and not _is_false(value):
                    problems.append(f"{where}: setattr {FLAG}")
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values, strict=True):
                if isinstance(k, ast.Constant) and k.value == FLAG and not _is_false(v):
                    problems.append(f"{where}: {{'{FLAG}': {ast.unparse(v)}}}")
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                key = target.slice if isinstance(target, ast.Subscript) else None
                attr = target.attr if isinstance(target, ast.Attribute) else None
                named = (isinstance(key, ast.Constant) and key.value == FLAG) or attr == FLAG
                if named and not _is_false(node.value):
                    problems.append(f"{where}: assigns {FLAG} = {ast.unparse(node.value)}")
    # Belt and braces for forms the AST rules miss (strings built for eval, YAML in code).
    for n, line in enumerate(source.splitlines(), 1):
        if RAW.search(line) and "RAW = re.compile" not in line:
            problems.append(f"{name}:{n}: text sets {FLAG}: {line.strip()}")
    return sorted(set(problems))


def _python_files() -> list[Path]:
    files: list[Path] = []
    for top in SCANNED:
        d = ROOT / top
        if d.is_dir():
            files.extend(p for p in d.rglob("*.py") if ".venv" not in p.parts)
    return sorted(files)


def test_scanner_catches_every_form() -> None:
    """Each bad form is flagged and each safe form is not (so a clean scan means something)."""
    bad = [
        "m.from_pretrained(p, trust_remote_code=True)",
        "m.from_pretrained(p, trust_remote_code=flag)",
        "m.from_pretrained(p, **kwargs)",
        "kw = {'trust_remote_code': True}",
        "kw['trust_remote_code'] = allow",
        "cfg.trust_remote_code = 1",
        "setattr(cfg, 'trust_remote_code', True)",
        "pipeline('x', trust_remote_code=os.environ.get('T'))",
    ]
    for src in bad:
        assert scan_source(src), src
    good = [
        "m.from_pretrained(p, trust_remote_code=False)",
        "kw = {'trust_remote_code': False}",
        "m.from_pretrained(p, local_files_only=True)",
    ]
    for src in good:
        assert scan_source(src) == [], src


def test_no_code_sets_trust_remote_code() -> None:
    files = _python_files()
    assert any(f.parts[-3:] == ("maec_core", "maec", "gradient.py") for f in files) or files
    problems = [p for f in files for p in scan_source(f.read_text(), str(f.relative_to(ROOT)))]
    assert problems == [], "\n".join(problems)


REMOTE_CODE = """
from pathlib import Path
Path({marker!r}).write_text("remote code ran")
"""


def _plant_remote_code(folder: Path, marker: Path) -> None:
    """auto_map entries in config.json and tokenizer_config.json naming modules in the
    folder that leave ``marker`` when imported, as a hostile hub repository would."""
    (folder / "modeling_evil.py").write_text(REMOTE_CODE.format(marker=str(marker)))
    (folder / "tokenization_evil.py").write_text(REMOTE_CODE.format(marker=str(marker)))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    (folder / "config.json").write_text(json.dumps(cfg))
    tok_cfg_path = folder / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.exists() else {}
    tok_cfg["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    tok_cfg_path.write_text(json.dumps(tok_cfg))


def _wrap_from_pretrained(monkeypatch: pytest.MonkeyPatch, calls: list[tuple[str, Any]]) -> None:
    import transformers
    from transformers import PreTrainedModel
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase

    owners = [
        transformers.AutoConfig,
        transformers.AutoTokenizer,
        transformers.AutoModelForCausalLM,
        PreTrainedModel,
        PreTrainedTokenizerBase,
    ]
    for owner in owners:
        static = inspect.getattr_static(owner, "from_pretrained")
        func = static.__func__ if isinstance(static, classmethod | staticmethod) else static
        is_static = isinstance(static, staticmethod)

        def make(func: Any = func, owner: Any = owner, is_static: bool = is_static) -> Any:
            def wrapped(*args: Any, **kwargs: Any) -> Any:
                calls.append((owner.__name__, kwargs.get(FLAG)))
                return func(*args, **kwargs)

            return staticmethod(wrapped) if is_static else classmethod(wrapped)

        monkeypatch.setattr(owner, "from_pretrained", make())


@pytest.mark.slow
def test_gradient_pass_never_trusts_remote_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from maec_core.errors import MaecError
    from maec_core.io.folder import open_model_folder
    from maec_core.maec.gradient import gradient_scores
    from maec_core.maec.params import MaecParams
    from tests.factories import make_llama

    base = make_llama(tmp_path / "base", seed=0)
    marker = tmp_path / "REMOTE-CODE-RAN"
    _plant_remote_code(base, marker)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(" ".join(f"w{i % 61}" for i in range(400)) + "\n")
    calls: list[tuple[str, Any]] = []
    _wrap_from_pretrained(monkeypatch, calls)

    import torch

    params = MaecParams.model_validate(
        {"importance": "gradient", "token_budget": 64, "seq_len": 16, "batch_size": 2}
    )
    name = "model.layers.0.mlp.down_proj.weight"
    try:
        scores, _ = gradient_scores(params, open_model_folder(base), str(corpus), [name],
                                    torch.device("cpu"))
        assert name in scores
    except MaecError:
        # Refusing the folder is as good as ignoring its code; running it is not.
        pass
    assert calls, "the wrapper saw no from_pretrained call: the check checked nothing"
    truthy = [(owner, v) for owner, v in calls if v]
    assert truthy == [], truthy
    assert not marker.exists(), "remote code from the checkpoint folder ran"
