"""The ``mergekit-yaml`` options ``maec merge`` takes, declared once, each with how it is
handled: the same meaning here (``same``), accepted with no effect because the engine
always works that way (``no_effect``, a note on stderr says why), or refused with the
reason (``refused``, exit 2 before anything is read).

:data:`MERGEKIT_FLAGS` is the one table: :func:`mergekit_flags` generates the click
options from it, :meth:`MergekitFlags.apply` carries out the ``same`` ones, and
docs/compatibility.md lists it (tests/core/test_cli_mergekit.py checks they agree).
Torch-free.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import click

from maec_core.errors import RecipeError
from maec_core.recipe import Recipe

Handling = Literal["same", "no_effect", "refused"]
C = TypeVar("C", bound=Callable[..., Any])


@dataclass(frozen=True)
class MergekitFlag:
    """One mergekit-yaml option: its click declaration, its value when not given
    (mergekit's default), and how ``maec merge`` handles it; ``why`` says what
    happens. A ``refused`` option is refused whenever it is given a value other than
    its default."""

    name: str
    decls: tuple[str, ...]
    handling: Handling
    why: str
    default: Any = False
    is_flag: bool = True
    type: Any = None
    # A value refused although the option is otherwise the same (--no-copy-tokenizer).
    refused_when: Any = None


def _flag(name: str, handling: Handling, why: str, *, off: bool = True,
          default: Any = False, refused_when: Any = None) -> MergekitFlag:
    dashed = name.replace("_", "-")
    decls = (f"--{dashed}/--no-{dashed}",) if off else (f"--{dashed}",)
    return MergekitFlag(name, decls, handling, why, default=default,
                        refused_when=refused_when)


def _value(name: str, handling: Handling, why: str, kind: Any) -> MergekitFlag:
    return MergekitFlag(name, (f"--{name.replace('_', '-')}",), handling, why, default=None,
                        is_flag=False, type=kind)


MERGEKIT_FLAGS: tuple[MergekitFlag, ...] = (
    _flag("cuda", "same", "computes on the GPU (as --device cuda)"),
    _value("out_shard_size", "same", "parameters per output shard (5B, 500M, 1000000), "
           "as mergekit counts them; the shard's bytes are that times the written "
           "dtype's size (2 bytes when the recipe names no dtype); replaces the "
           "recipe's out_shard_size", str),
    _value("random_seed", "same", "seeds DARE's and DELLA's masks (the recipe's "
           "random_seed parameter, when the recipe gives none); no effect on a "
           "method without random draws", int),
    _flag("quiet", "same", "no progress bars (as --no-progress)"),
    _flag("copy_tokenizer", "same", "the output carries its tokenizer files (the "
          "default); --no-copy-tokenizer is refused: the output folder is published "
          "complete, loadable as it is", default=True, refused_when=False),
    _flag("write_model_card", "same", "README.md describes the merge (the default); "
          "--no-write-model-card is refused: the card is where ignored recipe fields are "
          "listed", default=True, refused_when=False),
    _flag("safe_serialization", "same", "safetensors output (the default; "
          "--no-safe-serialization is refused: pickles are never written)",
          default=True, refused_when=False),
    _flag("allow_crimes", "refused", "mixing architectures is refused: every input must "
          "have the same architecture (the merge checks their configs first)"),
    _flag("trust_remote_code", "refused", "model code from a checkpoint is never run"),
    _flag("unsafe_truncate_embeddings", "refused", "vocabularies are merged by token "
          "(tokenizer_source / tokenizer), never by truncating rows"),
    _value("lora_merge_dtype", "refused", "a LoRA donor is applied in the merge's "
           "compute dtype", str),
    _value("transformers_cache", "refused", "the command line reads local folders; hub "
           "downloads belong to the service (pinned revisions)", str),
    _value("lora_merge_cache", "no_effect", "a LoRA donor is applied tensor by tensor as "
           "it is read; nothing is cached", str),
    _flag("lazy_unpickle", "no_effect", "pickle checkpoints are refused, never "
          "unpickled; safetensors are always read lazily"),
    _flag("low_cpu_memory", "no_effect", "the engine streams: it never holds a model"),
    _flag("read_to_gpu", "no_effect", "with a GPU, inputs go to it as they are read"),
    _flag("multi_gpu", "no_effect", "one GPU per merge"),
    _flag("gpu_rich", "same", "computes on the GPU (as --cuda; the other options it "
          "implies have no effect here)", off=False),
    _flag("async_write", "no_effect", "shards are written while the merge computes"),
    _value("write_threads", "no_effect", "one writer thread", int),
    _flag("clone_tensors", "no_effect", "every output tensor is written from its own "
          "buffer"),
    MergekitFlag("num_threads", ("-j", "--num-threads"), "no_effect", "the engine sets "
                 "its own thread counts for the machine", default=None, is_flag=False,
                 type=int),
    MergekitFlag("verbose", ("-v",), "no_effect", "progress, warnings and errors are "
                 "always shown", default=0, is_flag=False, type=None),
)
_BY_NAME = {f.name: f for f in MERGEKIT_FLAGS}

_KMB = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9, "T": 10**12}
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def parse_parameter_count(text: str) -> int:
    """``5B``, ``500M``, ``250K`` or a plain number of parameters (RecipeError)."""
    value = text.strip().upper()
    unit = value[-1:] if value[-1:] in _KMB else ""
    number = value[:len(value) - len(unit)]
    try:
        count = int(float(number) * _KMB[unit])
    except ValueError:
        count = 0
    if count < 1:
        raise RecipeError(f"--out-shard-size {text!r} is not a parameter count like 5B",
                          option="--out-shard-size")
    return count


@dataclass(frozen=True)
class MergekitFlags:
    """The mergekit-yaml options one ``maec merge`` was given (name -> value)."""

    given: dict[str, Any] = field(default_factory=dict)

    def refusals(self) -> list[str]:
        """One line per option given that is refused, naming it and why."""
        out = []
        for name, value in self.given.items():
            flag = _BY_NAME[name]
            if value is None or value == flag.default:
                continue
            if flag.handling == "refused" or value == flag.refused_when:
                shown = f"--no-{name}" if value is False else f"--{name}"
                out.append(f"{shown.replace('_', '-')} is not supported: {flag.why}")
        return out

    def notes(self) -> list[str]:
        return [f"--{n.replace('_', '-')} has no effect here: {_BY_NAME[n].why}"
                for n, v in self.given.items()
                if _BY_NAME[n].handling == "no_effect" and v not in (None, False, 0)]

    @property
    def device(self) -> str | None:
        return "cuda" if self.given.get("cuda") or self.given.get("gpu_rich") else None

    @property
    def quiet(self) -> bool:
        return bool(self.given.get("quiet"))

    def apply(self, recipe: Recipe) -> Recipe:
        """``recipe`` with the options that change it applied (shard size, seed)."""
        update: dict[str, Any] = {}
        size = self.given.get("out_shard_size")
        if size is not None:
            itemsize = _ITEMSIZE.get(recipe.output_dtype or "bfloat16", 2)
            update["out_shard_size"] = parse_parameter_count(size) * itemsize
        seed = self.given.get("random_seed")
        if seed is not None and "random_seed" not in recipe.parameters:
            from maec_core.methods.base import field_keys
            from maec_core.methods.registry import get_method

            method = get_method(recipe.merge_method)
            if "random_seed" in field_keys(method.params):
                update["parameters"] = {**recipe.parameters, "random_seed": seed}
        return recipe.model_copy(update=update) if update else recipe


def mergekit_flags(command: C) -> C:
    """Decorate ``maec merge`` with every option of :data:`MERGEKIT_FLAGS`; the command
    receives them as one ``mergekit`` argument."""
    names = [f.name for f in MERGEKIT_FLAGS]

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        given = {n: kwargs.pop(n) for n in names}
        kwargs["mergekit"] = MergekitFlags(given)
        return command(*args, **kwargs)

    decorated: Any = wrapper
    for flag in reversed(MERGEKIT_FLAGS):
        extra: dict[str, Any] = ({"is_flag": True} if flag.is_flag
                                 else {"count": True} if flag.name == "verbose"
                                 else {"type": flag.type})
        decorated = click.option(*flag.decls, flag.name, default=flag.default,
                                 help=f"mergekit-yaml's option: {flag.why}",
                                 **extra)(decorated)
    return decorated  # type: ignore[no-any-return]
