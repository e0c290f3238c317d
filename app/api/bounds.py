"""Length bounds on what requests name (job ids, file paths, sizes), checked before any
conversion or lookup.

Python's ``int()`` refuses strings of more than 4300 digits with a ValueError and
``float()`` turns long ones into ``inf``; either used to surface as a 500. Bounding the
text first keeps every such input a 4xx with a code, and keeps a caller's megabyte of
text out of Redis keys and error messages.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel, ByteSize, TypeAdapter, ValidationError

from maec_core.errors import RecipeError

# Job ids are ``j_`` + 24 hex digits; anything much longer names no job.
MAX_ID_CHARS = 64
# Published file paths are a checkpoint's file names (with an optional folder).
MAX_PATH_CHARS = 1024
MAX_SIZE_CHARS = 32
# Largest size accepted: any file size fits a signed 64-bit integer.
MAX_SIZE_BYTES = 2**63 - 1
_BYTE_SIZE: TypeAdapter[ByteSize] = TypeAdapter(ByteSize)
M = TypeVar("M", bound=BaseModel)


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
