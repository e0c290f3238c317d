"""Length bounds on what requests name (job ids, file paths, sizes), checked before any
conversion or lookup, and the text and nesting bounds every job body is held to.

Python's ``int()`` refuses strings of more than 4300 digits with a ValueError and
``float()`` turns long ones into ``inf``; either used to surface as a 500. Bounding the
text first keeps every such input a 4xx with a code, and keeps a caller's megabyte of
text out of Redis keys and error messages.

A job body is JSON, and JSON can carry what the service can neither store nor send back:
a lone UTF-16 surrogate (``"\\ud800"`` decodes to a Python str that no UTF-8 encoder
takes) and nesting deeper than the serialisers recurse. Both are refused by
:func:`check_body` on the parsed body, once, before any model validation, so every
free-form field (an MoE config, extra parameters, prompts, names, keys as well as
values) is covered by construction rather than field by field.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ByteSize, TypeAdapter, ValidationError

from maec_core.service import RecipeError

# Job ids are ``j_`` + 24 hex digits; anything much longer names no job.
MAX_ID_CHARS = 64
# Published file paths are a checkpoint's file names (with an optional folder).
MAX_PATH_CHARS = 1024
MAX_SIZE_CHARS = 32
# Largest size accepted: any file size fits a signed 64-bit integer.
MAX_SIZE_BYTES = 2**63 - 1
_BYTE_SIZE: TypeAdapter[ByteSize] = TypeAdapter(ByteSize)
M = TypeVar("M", bound=BaseModel)
# Deepest container nesting a job body may have (the body object itself is level 1). The
# deepest real body (a recipe's slice sources' per-model conditions with gradient lists)
# nests ten levels; pydantic stops serialising a value past about 250 levels and the
# record is serialised several times on its way to the store, so the bound sits far
# below that and far above any recipe (docs/api.md).
MAX_BODY_DEPTH = 32


class BodyProblem(ValueError):
    """Text or nesting a job body may not hold; ``where`` is its location."""

    def __init__(self, kind: str, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}" if where else message)
        self.kind = kind
        self.where = where


def _unencodable(text: str) -> bool:
    # Only a lone surrogate (U+D800..U+DFFF) makes a str unencodable as UTF-8.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _place(path: tuple[str | int, ...]) -> str:
    # ascii(): a key that itself holds a lone surrogate is shown escaped, never raw.
    return ".".join(str(p) if isinstance(p, int) or not _unencodable(p) else ascii(p)[1:-1]
                    for p in path)


def check_body(body: Any, max_depth: int = MAX_BODY_DEPTH) -> None:
    """Refuse a parsed JSON body holding a lone surrogate in any key or string value, or
    containers nested deeper than ``max_depth``. Raises BodyProblem (``kind``
    ``invalid_text`` or ``too_deep``) naming the first offending place.

    Iterative (an explicit stack), so that checking a deep body cannot itself exhaust
    the interpreter's recursion limit."""
    stack: list[tuple[Any, tuple[str | int, ...], int]] = [(body, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if _unencodable(value):
                raise BodyProblem("invalid_text", _place(path),
                                  "text holds a lone UTF-16 surrogate, which is not "
                                  "Unicode text; send valid UTF-8")
            continue
        if not isinstance(value, dict | list):
            continue
        if depth > max_depth:
            raise BodyProblem("too_deep", _place(path[:max_depth]),
                              f"nested deeper than {max_depth} levels")
        if isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and _unencodable(key):
                    raise BodyProblem("invalid_text", _place((*path, key)),
                                      "a key holds a lone UTF-16 surrogate, which is not "
                                      "Unicode text; send valid UTF-8")
                stack.append((item, (*path, key), depth + 1))
        else:
            stack.extend((item, (*path, i), depth + 1) for i, item in enumerate(value))


def shown(text: str, limit: int = MAX_ID_CHARS) -> str:
    """``text`` as it may be repeated in an error: cut to ``limit`` characters."""
    return text if len(text) <= limit else text[:limit] + "..."


def byte_size(value: Any, what: str = "out_shard_size") -> Any:
    """A size string (``5GB``, ``500MiB``, ``1048576``) or number as a bounded int of
    bytes, through pydantic's ByteSize; other types are left to the recipe's own
    validation. Raises RecipeError (``invalid_recipe``)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        if len(value) > MAX_SIZE_CHARS:
            raise RecipeError(f"{what} is longer than {MAX_SIZE_CHARS} characters; give a "
                              "size like '5GB'", key=what)
        try:
            value = int(_BYTE_SIZE.validate_python(value))
        except (ValidationError, ValueError, OverflowError):
            raise RecipeError(f"{what} {value!r} is not a size like '5GB'", key=what) from None
    if isinstance(value, int | float) and not 0 <= value <= MAX_SIZE_BYTES:
        raise RecipeError(f"{what} must be between 0 and {MAX_SIZE_BYTES} bytes", key=what)
    return value


def bounded_sizes(body: M) -> M:
    """The request with its shard size (named form ``shard_size``, recipe form
    ``recipe.out_shard_size``) converted to bytes, so that the recipe parser only ever
    sees a bounded integer."""
    update: dict[str, Any] = {}
    if getattr(body, "shard_size", None) is not None:
        update["shard_size"] = byte_size(body.shard_size)  # type: ignore[attr-defined]
    recipe = getattr(body, "recipe", None)
    if isinstance(recipe, dict) and recipe.get("out_shard_size") is not None:
        update["recipe"] = {**recipe, "out_shard_size": byte_size(recipe["out_shard_size"])}
    return body.model_copy(update=update) if update else body
