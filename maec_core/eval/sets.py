"""Eval specs and eval sets, parsed and checked without torch.

An eval spec (YAML) lists eval sets; each names a language, a kind (``perplexity`` on a
text set, ``accuracy`` on a question/answer set) and a file; or, of kind ``lm_eval``, a
task of lm-evaluation-harness, which reads its own data when it runs
(:mod:`maec_core.eval.lm_eval_tasks`). The API checks a spec and
reads its sets with this module at submission, so nothing here imports torch; the
measuring modules (:mod:`maec_core.eval.measure`, :mod:`maec_core.eval.runner`) do.

Set files:
- text sets: JSONL (``{"text": ...}`` per line) or plain text, one document per
  paragraph (paragraphs end at blank lines);
- question/answer sets: JSONL (``{"question": ..., "answer": ...}``) or MGSM's TSV
  layout (``question<TAB>answer``, split at the last tab). Gold answers must be numbers;
  few-shot exemplar answers may be any text (worked solutions).

Every failure names the file and, for a bad line, its line number
(:class:`~maec_core.errors.EvalSetError`); a file that cannot be read at all is
:class:`~maec_core.errors.EvalSetUnreadable`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from maec_core.errors import EvalSetError, EvalSetUnreadable
from maec_core.eval.answers import parse_number

# Caps: a spec is a few KB; a set file is read whole into memory; a question is a
# paragraph, a gold answer one number.
SPEC_MAX_BYTES = 1 << 20
SET_MAX_BYTES = 64 << 20
MAX_SETS = 64
MAX_ITEMS = 100_000
MAX_EXEMPLARS = 32
MAX_QUESTION_CHARS = 16_384
MAX_GOLD_CHARS = 64
MAX_TEMPLATE_CHARS = 4096
MAX_PATH_CHARS = 1024
DEFAULT_TEMPLATE = "Question: {question}\nAnswer:"
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_BATCH_SIZE = 8
# Exemplars and the question are separated by a blank line, so a model that imitates
# the exemplars ends its answer with one: the default stop string.
SHOT_SEPARATOR = "\n\n"
JSONL_SUFFIXES = (".jsonl", ".ndjson")
TSV_SUFFIXES = (".tsv",)

# lm_eval: a task of lm-evaluation-harness, run by it (maec_core.eval.lm_eval_tasks).
Kind = Literal["perplexity", "accuracy", "lm_eval"]
Format = Literal["jsonl", "tsv", "text"]
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
# lm-eval's names: "mgsm_direct_bn", "tmmluplus_education_(profession_level)".
LM_EVAL_TASK_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._()-]*$"
# lm-eval's metric keys: "acc", "acc_norm", "exact_match,flexible-extract".
LM_EVAL_METRIC_PATTERN = r"^[A-Za-z0-9_]+(?:,[A-Za-z0-9_.-]+)?$"
# BCP-47-like: "sw", "swh", "en-US", "zh_Hant".
LANGUAGE_PATTERN = r"^[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{2,8})*$"


def _infer_format(path: str) -> Format:
    suffix = Path(path).suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return "jsonl"
    return "tsv" if suffix in TSV_SUFFIXES else "text"


class FewShot(BaseModel):
    """Exemplars prepended to every prompt: the first ``k`` items of ``path``.

    ``language`` records whether the exemplars are in the eval set's (target) language
    or in the source language the ability came from; it is reported, not acted on.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)
    k: int = Field(ge=1, le=MAX_EXEMPLARS)
    language: Literal["target", "source"]
    format: Literal["jsonl", "tsv"] | None = None

    @property
    def file_format(self) -> Format:
        return self.format or _infer_format(self.path)


class EvalSetSpec(BaseModel):
    """One eval set. Unset run-time values (context, stride) are chosen per model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, max_length=64, pattern=NAME_PATTERN)
    # lm_eval: defaults to the task name's language suffix (mgsm_direct_bn: bn).
    language: str = Field(default="und", max_length=35, pattern=LANGUAGE_PATTERN)
    kind: Kind
    # The set file; for lm_eval, an optional folder of task YAMLs (lm-eval's include_path).
    path: str | None = Field(default=None, min_length=1, max_length=MAX_PATH_CHARS)
    format: Format | None = None
    template: str | None = Field(default=None, max_length=MAX_TEMPLATE_CHARS)
    few_shot: FewShot | None = None
    max_new_tokens: int | None = Field(default=None, ge=1, le=4096)
    stop: list[str] | None = Field(default=None, max_length=8)
    context: int | None = Field(default=None, ge=2, le=1 << 20)
    stride: int | None = Field(default=None, ge=1, le=1 << 20)
    batch_size: int = Field(default=DEFAULT_BATCH_SIZE, ge=1, le=1024)
    max_items: int | None = Field(default=None, ge=1, le=MAX_ITEMS)
    # lm_eval only: lm-eval's task name (default: name), its limit and num_fewshot, and
    # which of its metrics is this set's value (a sweep's objective or constraint).
    task: str | None = Field(default=None, min_length=1, max_length=128,
                             pattern=LM_EVAL_TASK_PATTERN)
    limit: int | None = Field(default=None, ge=1, le=MAX_ITEMS)
    num_fewshot: int | None = Field(default=None, ge=0, le=MAX_EXEMPLARS)
    metric: str | None = Field(default=None, min_length=1, max_length=128,
                               pattern=LM_EVAL_METRIC_PATTERN)

    @model_validator(mode="before")
    @classmethod
    def _task_language(cls, data: Any) -> Any:
        # lm-eval's per-language tasks end in the language (mgsm_direct_bn, arc_sw).
        if isinstance(data, dict) and data.get("kind") == "lm_eval" and "language" not in data:
            task = data.get("task") or data.get("name")
            tail = task.rsplit("_", 1)[-1] if isinstance(task, str) and "_" in task else ""
            if 2 <= len(tail) <= 3 and tail.isalpha() and tail.islower():
                return {**data, "language": tail}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> EvalSetSpec:
        given = {k for k in self.model_fields_set if getattr(self, k) is not None}
        only = {"perplexity": {"context", "stride"},
                "accuracy": {"template", "few_shot", "max_new_tokens", "stop"},
                "lm_eval": {"task", "limit", "num_fewshot", "metric"}}
        owner = {key: kind for kind, keys in only.items() for key in keys}
        wrong = sorted(k for k in given if owner.get(k, self.kind) != self.kind)
        if wrong:
            raise ValueError(f"{', '.join(wrong)}: only for kind {owner[wrong[0]]}")
        if self.kind == "lm_eval":
            if "max_items" in given:
                raise ValueError("max_items: an lm_eval set takes limit")
            return self
        if self.path is None:
            raise ValueError(f"a {self.kind} set needs path (its file)")
        if "language" not in self.model_fields_set:
            raise ValueError(f"a {self.kind} set needs language")
        if self.kind == "accuracy" and self.file_format == "text":
            raise ValueError("an accuracy set is JSONL or TSV: name it *.jsonl or *.tsv, "
                             "or give format: jsonl|tsv")
        if self.kind == "perplexity" and self.file_format == "tsv":
            raise ValueError("a perplexity set is JSONL or plain text")
        if self.template is not None and "{question}" not in self.template:
            raise ValueError("template must contain {question}")
        if self.stop is not None and not all(0 < len(s) <= 64 for s in self.stop):
            raise ValueError("stop strings must have 1 to 64 characters")
        if self.context and self.stride and self.stride > self.context:
            raise ValueError(f"stride {self.stride} is larger than context {self.context}")
        return self

    @property
    def file_format(self) -> Format:
        return self.format or _infer_format(self.path or "")

    @property
    def lm_eval_task(self) -> str:
        return self.task or self.name

    @property
    def file(self) -> str:
        """The set file (perplexity and accuracy sets always have one)."""
        if self.path is None:
            raise EvalSetError(f"eval set {self.name!r} has no file", set=self.name)
        return self.path

    @property
    def prompt_template(self) -> str:
        return self.template if self.template is not None else DEFAULT_TEMPLATE

    @property
    def new_tokens(self) -> int:
        return self.max_new_tokens or DEFAULT_MAX_NEW_TOKENS

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop) if self.stop is not None else [SHOT_SEPARATOR]


class EvalSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    sets: list[EvalSetSpec] = Field(min_length=1, max_length=MAX_SETS)

    @model_validator(mode="after")
    def _unique_names(self) -> EvalSpec:
        seen: set[str] = set()
        for s in self.sets:
            if s.name in seen:
                raise ValueError(f"two eval sets are named {s.name!r}")
            seen.add(s.name)
        return self


# ---------------------------------------------------------------------------- specs


def load_spec(path: str | Path, *, root: Path | None = None) -> EvalSpec:
    """Read and check an eval spec file; set paths are taken relative to its folder.

    With ``root``, every set file must lie inside it (after resolving links and ``..``).
    """
    p = Path(path)
    text = _read_text(p, what="eval spec", max_bytes=SPEC_MAX_BYTES)
    return parse_spec(text, source=p.name, base_dir=p.parent, root=root)


def parse_spec(text: str, *, source: str = "eval spec", base_dir: Path | None = None,
               root: Path | None = None) -> EvalSpec:
    """Parse YAML text: a list of sets, or a mapping with a ``sets`` list.

    Relative set paths are resolved against ``base_dir`` (default: the working
    directory). Errors name the line of the offending entry.
    """
    if len(text.encode()) > SPEC_MAX_BYTES:
        raise EvalSetError(f"{source} is larger than {SPEC_MAX_BYTES} bytes", file=source)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        where = f" line {line}" if line else ""
        raise EvalSetError(f"{source}{where} is not valid YAML: "
                           f"{getattr(exc, 'problem', None) or exc}",
                           file=source, line=line) from None
    bare_list = isinstance(doc, list)
    try:
        spec = EvalSpec.model_validate({"sets": doc} if bare_list else doc)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = list(err["loc"])[1:] if bare_list else list(err["loc"])
        line = _node_line(node, loc)
        field = ".".join(str(x) for x in err["loc"])
        where = f" line {line}" if line else ""
        # Our own checks read better without pydantic's "Value error, " prefix.
        msg = str(err["ctx"]["error"]) if err["type"] == "value_error" else err["msg"]
        raise EvalSetError(f"{source}{where}: {field or 'spec'}: {msg}",
                           file=source, line=line, field=field) from None
    base = base_dir if base_dir is not None else Path.cwd()
    return spec.model_copy(update={"sets": [_resolved(s, base, root) for s in spec.sets]})


def _node_line(node: yaml.Node | None, loc: list[Any]) -> int | None:
    """The 1-based line of the YAML node at ``loc`` (or its deepest existing parent)."""
    if node is None:
        return None
    for key in loc:
        child: yaml.Node | None = None
        if isinstance(node, yaml.MappingNode):
            child = next((v for k, v in node.value if k.value == key), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int):
            child = node.value[key] if key < len(node.value) else None
        if child is None:
            break
        node = child
    return int(node.start_mark.line) + 1


def _resolved(s: EvalSetSpec, base: Path, root: Path | None) -> EvalSetSpec:
    if s.path is None:
        return s
    update: dict[str, Any] = {"path": str(_resolve_path(s.path, base, root, s.name))}
    if s.few_shot is not None:
        shot_path = _resolve_path(s.few_shot.path, base, root, s.name)
        update["few_shot"] = s.few_shot.model_copy(update={"path": str(shot_path)})
    return s.model_copy(update=update)


def _resolve_path(path: str, base: Path, root: Path | None, name: str) -> Path:
    p = Path(path)
    full = (p if p.is_absolute() else base / p).resolve()
    if root is not None and not full.is_relative_to(root.resolve()):
        raise EvalSetError(f"eval set {name!r}: {path} is outside the allowed folder",
                           set=name, path=path)
    return full


# ----------------------------------------------------------------------------- sets


@dataclass(frozen=True)
class QAItem:
    question: str
    # Gold items: the canonical number; exemplars: the answer text as written.
    answer: str


@dataclass(frozen=True)
class LoadedSet:
    """An eval set read and checked: documents (perplexity) or items (accuracy)."""

    spec: EvalSetSpec
    texts: tuple[str, ...] = ()
    items: tuple[QAItem, ...] = ()
    exemplars: tuple[QAItem, ...] = ()

    def prompt(self, question: str) -> str:
        """The prompt for ``question``: the exemplars (template + " " + answer), then the
        templated question, separated by blank lines."""
        template = self.spec.prompt_template
        shots = [template.replace("{question}", e.question) + " " + e.answer
                 for e in self.exemplars]
        return SHOT_SEPARATOR.join([*shots, template.replace("{question}", question)])


def load_sets(spec: EvalSpec) -> list[LoadedSet]:
    return [load_set(s) for s in spec.sets]


def load_set(spec: EvalSetSpec) -> LoadedSet:
    """Read one set (and its exemplars), checking every line up to ``max_items``. An
    lm_eval set has nothing to read here: lm-eval reads its task when it runs."""
    if spec.kind == "lm_eval":
        return LoadedSet(spec)
    path = Path(spec.file)
    if spec.kind == "perplexity":
        texts = tuple(_read_texts(path, spec.file_format, spec.max_items))
        if not texts:
            raise EvalSetError(f"eval set {spec.name!r}: {path.name} has no text",
                               set=spec.name, file=path.name)
        return LoadedSet(spec, texts=texts)
    items = tuple(_read_qa(path, spec.file_format, spec.max_items, gold=True))
    if not items:
        raise EvalSetError(f"eval set {spec.name!r}: {path.name} has no items",
                           set=spec.name, file=path.name)
    exemplars: tuple[QAItem, ...] = ()
    if spec.few_shot is not None:
        shot = spec.few_shot
        shot_path = Path(shot.path)
        exemplars = tuple(_read_qa(shot_path, shot.file_format, shot.k, gold=False))
        if len(exemplars) < shot.k:
            raise EvalSetError(
                f"eval set {spec.name!r}: {shot_path.name} has {len(exemplars)} exemplars, "
                f"fewer than k={shot.k}", set=spec.name, file=shot_path.name)
    return LoadedSet(spec, items=items, exemplars=exemplars)


def _read_text(path: Path, *, what: str, max_bytes: int) -> str:
    try:
        if not path.is_file():
            raise EvalSetUnreadable(f"{what} {path.name} not found (or not a file)",
                                    file=str(path))
        size = path.stat().st_size
        if size > max_bytes:
            raise EvalSetError(f"{what} {path.name} is {size} bytes, above the "
                               f"{max_bytes} byte cap", file=path.name, bytes=size)
        raw = path.read_bytes()
    except OSError as exc:
        raise EvalSetUnreadable(f"cannot read {what} {path.name}: {exc.strerror}",
                                file=str(path)) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise EvalSetUnreadable(f"{what} {path.name} line {line} is not UTF-8 text",
                                file=path.name, line=line) from None


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """Non-blank lines with their 1-based numbers."""
    text = _read_text(path, what="eval set", max_bytes=SET_MAX_BYTES)
    # Split at "\n" only: str.splitlines also breaks at U+2028 and friends, which JSON
    # strings may hold, and would misnumber lines against an editor's count.
    for n, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if line.strip():
            yield n, line


def _capped(items: Iterator[Any], limit: int | None, path: Path) -> Iterator[Any]:
    """At most ``limit`` items; without a limit, more than MAX_ITEMS is an error."""
    for count, item in enumerate(items, 1):
        if limit is not None and count > limit:
            return
        if count > MAX_ITEMS:
            raise EvalSetError(f"{path.name} has more than {MAX_ITEMS} items; set max_items",
                               file=path.name)
        yield item


def _bad(path: Path, line: int, why: str) -> EvalSetError:
    return EvalSetError(f"{path.name} line {line}: {why}", file=path.name, line=line)


def _read_texts(path: Path, fmt: Format, limit: int | None) -> Iterator[str]:
    return _capped(_jsonl_texts(path) if fmt == "jsonl" else _paragraphs(path), limit, path)


def _jsonl_texts(path: Path) -> Iterator[str]:
    for n, line in _lines(path):
        doc = _json_object(path, n, line)
        text = doc.get("text")
        if not isinstance(text, str):
            raise _bad(path, n, 'expected {"text": "..."} with a string "text"')
        if text.strip():
            yield text


def _paragraphs(path: Path) -> Iterator[str]:
    """Plain text: each run of non-blank lines is a document (its lines joined by
    newlines, the blank separator lines dropped)."""
    para: list[str] = []
    text = _read_text(path, what="eval set", max_bytes=SET_MAX_BYTES)
    for line in text.split("\n"):
        if line.strip():
            para.append(line.removesuffix("\r"))
        elif para:
            yield "\n".join(para)
            para = []
    if para:
        yield "\n".join(para)


def _json_object(path: Path, n: int, line: str) -> dict[str, Any]:
    try:
        doc = json.loads(line)
    except (ValueError, RecursionError):
        raise _bad(path, n, "not JSON") from None
    if not isinstance(doc, dict):
        raise _bad(path, n, "expected a JSON object")
    return doc


def _read_qa(path: Path, fmt: Format, limit: int | None, *, gold: bool) -> Iterator[QAItem]:
    raw = _jsonl_qa(path) if fmt == "jsonl" else _tsv_qa(path)
    return _capped((_checked(path, n, q, a, gold) for n, q, a in raw), limit, path)


def _jsonl_qa(path: Path) -> Iterator[tuple[int, str, str]]:
    for n, line in _lines(path):
        doc = _json_object(path, n, line)
        q, a = doc.get("question"), doc.get("answer")
        if not isinstance(q, str):
            raise _bad(path, n, 'expected a string "question"')
        if isinstance(a, bool) or not isinstance(a, str | int | float):
            raise _bad(path, n, 'expected an "answer" (a string or a number)')
        yield n, q, str(a)


def _tsv_qa(path: Path) -> Iterator[tuple[int, str, str]]:
    for n, line in _lines(path):
        question, tab, answer = line.rpartition("\t")
        if not tab:
            raise _bad(path, n, "expected question<TAB>answer")
        yield n, question, answer


def _checked(path: Path, n: int, question: str, answer: str, gold: bool) -> QAItem:
    if not question.strip():
        raise _bad(path, n, "empty question")
    if len(question) > MAX_QUESTION_CHARS:
        raise _bad(path, n, f"question longer than {MAX_QUESTION_CHARS} characters")
    if not gold:
        if not answer.strip() or len(answer) > MAX_QUESTION_CHARS:
            raise _bad(path, n, f"exemplar answer empty or longer than {MAX_QUESTION_CHARS} "
                       "characters")
        return QAItem(question, answer.strip())
    number = parse_number(answer) if len(answer) <= MAX_GOLD_CHARS else None
    if number is None:
        raise _bad(path, n, f"answer {answer[:MAX_GOLD_CHARS]!r} is not a number")
    return QAItem(question, number)
