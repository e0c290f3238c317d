"""A recipe's ``chat_template``: a named template, literal Jinja, or ``auto``.

mergekit's meanings: a short name without braces names a built-in template; ``auto``
takes the template most of the input models carry (none when none does); anything else
with a ``{`` and at least 20 characters is the template itself. The chosen template is
written as ``chat_template.jinja`` beside the tokenizer (where transformers reads it),
and the copied tokenizer_config.json loses any template of its own.

The named templates are written here and render what mergekit's templates of the same
names render (checked in tests/core/test_chat_template.py against conversations).
Torch-free.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from pathlib import Path

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"

_CHATML = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' ~ message['role'] ~ '\\n' ~ message['content'] ~ '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
# Every turn ends with a newline after <|eot_id|>: mergekit's llama3 template renders
# one, and recipes naming it must get the same prompt text.
_LLAMA3 = (
    "{%- for message in messages -%}"
    "{%- if loop.first -%}{{ bos_token }}{%- endif -%}"
    "{{ '<|start_header_id|>' ~ message['role'] ~ '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim -}}{{ '<|eot_id|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif -%}"
)
_MISTRAL = (
    "{%- set system = messages[0]['content'] if messages[0]['role'] == 'system' "
    "else none -%}"
    "{%- set turns = messages[1:] if system is not none else messages -%}"
    "{{- bos_token -}}"
    "{%- for message in turns -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{- raise_exception('After the optional system message, conversation roles must "
    "alternate user/assistant/user/assistant/...') -}}{%- endif -%}"
    "{%- if message['role'] == 'user' -%}"
    "{%- if loop.first and system is not none -%}"
    "{{- ' [INST] ' ~ system ~ '\\n\\n' ~ message['content'] ~ ' [/INST]' -}}"
    "{%- else -%}{{- ' [INST] ' ~ message['content'] ~ ' [/INST]' -}}{%- endif -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- ' ' ~ message['content'] ~ eos_token -}}"
    "{%- else -%}{{- raise_exception('Only user and assistant roles are supported, with "
    "the exception of an initial optional system message!') -}}{%- endif -%}"
    "{%- endfor -%}"
)
NAMED: dict[str, str] = {"chatml": _CHATML, "llama3": _LLAMA3, "mistral": _MISTRAL}
# Names mergekit 0.1.5 ships that are not built in here (refused, naming the way out).
NOT_BUILT_IN = ("alpaca", "exaone")


def _looks_named(value: str) -> bool:
    return len(value) < 256 and "\n" not in value and "{" not in value


def check_chat_template(value: str) -> None:
    """ValueError unless ``value`` is ``auto``, a built-in name, or Jinja text."""
    if value == "auto" or value in NAMED:
        return
    if value in NOT_BUILT_IN:
        raise ValueError(f"chat_template {value!r} is one of mergekit's named templates "
                         f"that is not built in here (built in: auto, "
                         f"{', '.join(NAMED)}); give the template's Jinja text instead")
    if _looks_named(value) or len(value) < 20:
        raise ValueError(f"chat_template {value!r} is neither auto, a known template "
                         f"name ({', '.join(NAMED)}) nor Jinja text")


def model_template(folder: Path) -> str | None:
    """The chat template a checkpoint folder's tokenizer carries, if any."""
    jinja = folder / TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text()
    try:
        doc = json.loads((folder / TOKENIZER_CONFIG).read_text())
    except (OSError, ValueError):
        return None
    found = doc.get("chat_template") if isinstance(doc, dict) else None
    if isinstance(found, list):  # the named-templates form: the default one
        found = next((t.get("template") for t in found
                      if isinstance(t, dict) and t.get("name") == "default"), None)
    return found if isinstance(found, str) and found else None


def resolve_chat_template(value: str | None, folders: Iterable[Path]) -> str | None:
    """The template text a recipe's ``chat_template`` asks for (None: leave the copied
    tokenizer's as it is)."""
    if not value:
        return None
    if value == "auto":
        found = [t.strip() for t in (model_template(f) for f in folders) if t]
        return Counter(found).most_common(1)[0][0] if found else None
    return NAMED.get(value, value)


def with_chat_template(files: Mapping[str, bytes], template: str) -> dict[str, bytes]:
    """The tokenizer files with ``template`` as their chat template (its own file; any
    template inside tokenizer_config.json removed, so there is one)."""
    out = dict(files)
    if TOKENIZER_CONFIG in out:
        doc = json.loads(out[TOKENIZER_CONFIG])
        if isinstance(doc, dict) and "chat_template" in doc:
            del doc["chat_template"]
            out[TOKENIZER_CONFIG] = (json.dumps(doc, indent=2, ensure_ascii=False)
                                     + "\n").encode()
    out[TEMPLATE_FILE] = template.encode()
    return out
