"""A GGUF file as a plain Hugging Face folder (safetensors, config, tokenizer), made by
transformers' own GGUF loader: the merge then reads it like any other checkpoint.

The loader builds the whole model in memory: the float32 weights (4 bytes a parameter)
plus the one tensor being dequantized, and the file itself is memory-mapped (docs/gguf.md
states what a pool needs). Quantized weights are dequantized to float32; a file whose
tensors are all float16 or bfloat16 keeps that dtype.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from maec_core.errors import InvalidGguf, UnsupportedGguf
from maec_core.gguf.header import GgufHeader, check_readable, read_header

__all__ = ["GGUF_INFO_FILE", "dequantize_gguf", "memory_bytes"]

# Written into the dequantized folder: where the weights came from (the manifest and
# the job's warning read it).
GGUF_INFO_FILE = "gguf_source.json"
_CONFIG_DROP = ("quantization_config", "_name_or_path", "_model_name_or_path",
                "transformers_version", "dtype",
                "torch_dtype")


def memory_bytes(header: GgufHeader) -> int:
    """What dequantizing ``header``'s file holds in memory at its peak: the float32
    model, once, plus a quarter for the tensor being converted and the loader's own
    buffers (the file is memory-mapped, so its pages can be dropped)."""
    return header.parameters * 4 * 5 // 4


def _dtype(header: GgufHeader) -> str:
    kinds = {t for t, n in header.tensor_types.items() if n and t != "F32"}
    if kinds == {"F16"}:
        return "float16"
    if kinds == {"BF16"}:
        return "bfloat16"
    return "float32"


def dequantize_gguf(path: Path, out: Path, sha256: str = "") -> dict[str, Any]:
    """Write ``path`` (a GGUF file) dequantized into the new folder ``out`` (made in a
    temporary folder beside it and renamed, so it appears complete or not at all).

    Returns what ``out``'s ``gguf_source.json`` records: file name, sha256 (as given),
    architecture, quantization, tensor types and the dtype written."""
    header = read_header(path)
    check_readable(header, path.name)
    info = {"file": path.name, "sha256": sha256, **header.to_dict(), "dtype": _dtype(header)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        _convert(path, tmp, info["dtype"])
        (tmp / GGUF_INFO_FILE).write_text(json.dumps(info, indent=2))
        try:
            tmp.rename(out)
        except OSError:
            if not out.is_dir():  # another worker finished it first: theirs is the same
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return info


def _convert(path: Path, out: Path, dtype_name: str) -> None:
    """Load with transformers (dequantizing), then save as a fresh model of the same
    class: a GGUF-loaded model carries a quantizer that refuses ``save_pretrained``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, dtype_name)
    try:
        loaded = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=dtype)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, NotImplementedError, KeyError) as exc:
        # The header passed, so the tensors themselves (or the loader) disagree.
        raise UnsupportedGguf(f"{path.name}: transformers cannot load it ({exc})",
                              file=path.name) from None
    except (OSError, RuntimeError) as exc:
        raise InvalidGguf(f"{path.name}: its tensors cannot be read ({exc})",
                          file=path.name) from None
    fields = {k: v for k, v in loaded.config.to_dict().items() if k not in _CONFIG_DROP}
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    with torch.device("meta"):
        model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    del loaded
    model.to(dtype).save_pretrained(out)
    tok.save_pretrained(out)
