"""Telling a GGUF reference by its name, and the warning a GGUF input carries.

Kept apart from :mod:`~maec_core.gguf.header` (which needs numpy and the ``gguf``
package): ``maec merge`` checks every recipe for GGUF inputs, and a plain safetensors
merge should not pay for importing the parser it never uses.
"""

from __future__ import annotations

from maec_core.errors import UnsupportedGguf

__all__ = ["LOSSY_WARNING", "find_gguf", "is_gguf_name"]

LOSSY_WARNING = ("{source} is a {quantization} GGUF file: it is dequantized to be merged, which "
                 "is lossy (the merge reads the quantized weights, not the original "
                 "model's)")


def is_gguf_name(name: str) -> bool:
    return name.lower().endswith(".gguf")


def find_gguf(names: list[str]) -> str | None:
    """The one ``.gguf`` file among a folder's top-level ``names`` (None: there is none);
    two or more are ambiguous (a split or a second quantization) and refused."""
    found = sorted(n for n in names if "/" not in n and is_gguf_name(n))
    if len(found) > 1:
        raise UnsupportedGguf(
            f"the folder holds {len(found)} GGUF files ({', '.join(found[:4])}); name the "
            "one to merge (split GGUF files are not read)", files=found[:16])
    return found[0] if found else None
