"""The merged model as one GGUF file, written with ``gguf``'s own writer, tensor-name
maps and numpy quantizers (the pieces llama.cpp's converter is built from).

The names come from ``gguf.get_tensor_name_map`` (llama.cpp's map from Hugging Face names
to GGUF names) and the metadata keys from the writer's own methods; the file carries the
tokenizer (tokens, types, merges, special ids), the chat template and the provenance the
caller gives (``maec.recipe``, ``maec.inputs``). Tensors are written one at a time after
the header, so memory holds one tensor and its quantized copy, never the model.

Output types (``GGUF_TYPES``): the float types and the legacy block quantizations ``gguf``
quantizes in numpy. Its numpy code has no k-quant quantizer, so Q4_K and the like are
refused (``unsupported_gguf_output``): llama.cpp's ``llama-quantize`` makes them from the
f16 file.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from maec_core.errors import TokenizerError, UnsupportedGgufOutput

__all__ = ["ARCHITECTURES", "GGUF_TYPES", "check_output", "check_type", "gguf_name",
           "write_gguf"]

_Q = gguf.GGMLQuantizationType
_F = gguf.LlamaFileType
# Output type -> (tensor type, general.file_type).
GGUF_TYPES: dict[str, tuple[gguf.GGMLQuantizationType, gguf.LlamaFileType]] = {
    "f32": (_Q.F32, _F.ALL_F32), "f16": (_Q.F16, _F.MOSTLY_F16),
    "bf16": (_Q.BF16, _F.MOSTLY_BF16), "q8_0": (_Q.Q8_0, _F.MOSTLY_Q8_0),
    "q5_1": (_Q.Q5_1, _F.MOSTLY_Q5_1), "q5_0": (_Q.Q5_0, _F.MOSTLY_Q5_0),
    "q4_1": (_Q.Q4_1, _F.MOSTLY_Q4_1), "q4_0": (_Q.Q4_0, _F.MOSTLY_Q4_0),
}


@dataclass(frozen=True)
class _Arch:
    arch: gguf.MODEL_ARCH
    # llama.cpp's llama graph expects q/k rows in interleaved-rotary order (its
    # converter permutes them; transformers' GGUF loader permutes them back).
    permute_qk: bool


# Hugging Face model classes written, and the GGUF architecture each becomes.
ARCHITECTURES: dict[str, _Arch] = {
    "LlamaForCausalLM": _Arch(gguf.MODEL_ARCH.LLAMA, True),
    "MistralForCausalLM": _Arch(gguf.MODEL_ARCH.LLAMA, True),
    "Qwen2ForCausalLM": _Arch(gguf.MODEL_ARCH.QWEN2, False),
}


def check_type(qtype: str) -> str:
    """``qtype`` lower-cased, or ``UnsupportedGgufOutput`` naming what is written."""
    name = str(qtype).lower()
    if name not in GGUF_TYPES:
        raise UnsupportedGgufOutput(
            f"GGUF output type {qtype!r} is not written: use one of "
            f"{', '.join(GGUF_TYPES)} (k-quants: llama.cpp's llama-quantize from the f16 "
            "file)", type=str(qtype), supported=list(GGUF_TYPES))
    return name


def _config(folder: Path) -> dict[str, Any]:
    try:
        doc = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedGgufOutput(f"no readable config.json to describe the GGUF ({exc})"
                                    ) from None
    return doc if isinstance(doc, dict) else {}


def check_output(config: Mapping[str, Any]) -> _Arch:
    """The GGUF architecture of a model with this ``config.json``, or
    ``UnsupportedGgufOutput`` (raised before a merge starts)."""
    archs = config.get("architectures") or []
    arch = ARCHITECTURES.get(archs[0]) if archs else None
    if arch is None:
        raise UnsupportedGgufOutput(
            f"GGUF output is written for {', '.join(ARCHITECTURES)}; this model is "
            f"{archs[0] if archs else 'of no stated architecture'}",
            architecture=archs[0] if archs else None, supported=list(ARCHITECTURES))
    return arch


def gguf_name(qtype: str) -> str:
    """The output file's name inside the published folder."""
    return f"model-{qtype}.gguf"


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of each head from half-split rotary order into interleaved pairs."""
    return (w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _tensors(folder: Path) -> Iterator[tuple[str, np.ndarray]]:
    """Every tensor of the folder's safetensors files, as float32 numpy, one at a time."""
    from safetensors import safe_open

    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                yield name, f.get_tensor(name).float().numpy()


def _hparams(w: gguf.GGUFWriter, cfg: Mapping[str, Any]) -> None:
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    rope = cfg.get("rope_parameters") or {}
    w.add_context_length(int(cfg.get("max_position_embeddings", 2048)))
    w.add_embedding_length(hidden)
    w.add_block_count(int(cfg["num_hidden_layers"]))
    w.add_feed_forward_length(int(cfg["intermediate_size"]))
    w.add_head_count(heads)
    w.add_head_count_kv(int(cfg.get("num_key_value_heads") or heads))
    w.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_rope_dimension_count(int(cfg.get("head_dim") or hidden // heads))


def _vocab(w: gguf.GGUFWriter, folder: Path, n_vocab: int) -> None:
    """Tokens, their types and the special vocabulary (merges, ids, chat template), with
    ``gguf``'s own vocabulary readers; rows past the tokenizer's (padding) are UNUSED."""
    vocab: gguf.Vocab
    try:
        vocab = gguf.BpeVocab(folder)
    except (FileNotFoundError, ValueError, KeyError):
        try:
            vocab = gguf.LlamaHfVocab(folder)
        except (FileNotFoundError, ValueError, KeyError, ImportError) as exc:
            raise TokenizerError(f"the tokenizer cannot be written into GGUF ({exc})"
                                 ) from None
    tokens, types = [], []
    for text, _score, ttype in vocab.all_tokens():
        tokens.append(text)
        types.append(ttype)
    special = _special_ids(folder)
    for i in special:
        if i < len(types):
            types[i] = special[i]
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]".encode())
        types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model(vocab.tokenizer_model)
    # The pre-tokenizer's llama.cpp name is known only from a hash of its output on a
    # fixed text (a table inside llama.cpp's converter): "default" is written, so
    # llama.cpp uses its generic split (see docs/gguf.md).
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens[:n_vocab])
    w.add_token_types(types[:n_vocab])
    gguf.SpecialVocab(folder, load_merges=True, n_vocab=n_vocab).add_to_gguf(w, quiet=True)


def _special_ids(folder: Path) -> dict[int, gguf.TokenType]:
    """tokenizer.json's added tokens: special ones are CONTROL, the rest USER_DEFINED."""
    try:
        doc = json.loads((folder / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return {}
    return {int(t["id"]): (gguf.TokenType.CONTROL if t.get("special")
                           else gguf.TokenType.USER_DEFINED)
            for t in doc.get("added_tokens") or [] if "id" in t}


def _tensor_type(shape: tuple[int, ...], want: gguf.GGMLQuantizationType
                 ) -> gguf.GGMLQuantizationType:
    """1-D tensors (norms, biases) stay F32, as llama.cpp keeps them; a matrix whose rows
    are not whole blocks of ``want`` falls back to F16."""
    if len(shape) < 2 or want == _Q.F32:
        return _Q.F32
    block, _size = gguf.GGML_QUANT_SIZES[want]
    return want if shape[-1] % block == 0 else _Q.F16


def _plan(folder: Path, cfg: Mapping[str, Any], arch: _Arch, want: gguf.GGMLQuantizationType
          ) -> list[tuple[str, str, tuple[int, ...], gguf.GGMLQuantizationType, int]]:
    """(HF name, GGUF name, shape, type, heads to permute by or 0) of every tensor,
    from the safetensors headers alone."""
    from safetensors import safe_open

    names = gguf.get_tensor_name_map(arch.arch, int(cfg["num_hidden_layers"]))
    heads = int(cfg["num_attention_heads"])
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    out = []
    for shard in sorted(folder.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for hf in f.keys():  # noqa: SIM118
                shape = tuple(f.get_slice(hf).get_shape())
                if hf == "lm_head.weight" and cfg.get("tie_word_embeddings"):
                    continue  # tied: llama.cpp reuses token_embd
                mapped = names.get_name(hf, try_suffixes=(".weight", ".bias"))
                if mapped is None:
                    raise UnsupportedGgufOutput(f"tensor {hf} has no GGUF name in gguf's "
                                                "tensor-name map", tensor=hf)
                qtype = _tensor_type(shape, want)
                permute = 0
                if arch.permute_qk and hf.endswith("self_attn.q_proj.weight"):
                    permute = heads
                elif arch.permute_qk and hf.endswith("self_attn.k_proj.weight"):
                    permute = kv_heads
                out.append((hf, mapped, shape, qtype, permute))
    return out


def _nbytes(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * size


def _encode(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    if qtype == _Q.F32:
        return data.astype(np.float32)
    return np.asarray(gguf.quants.quantize(data, qtype))


def write_gguf(folder: Path, dest: Path, qtype: str, *, name: str = "",
               provenance: Mapping[str, str] | None = None) -> None:
    """Write the checkpoint in ``folder`` (safetensors, config.json, tokenizer) as the
    GGUF file ``dest`` of type ``qtype`` (``GGUF_TYPES``), through a temporary file
    renamed into place. ``provenance``: string metadata written under ``maec.``."""
    want, file_type = GGUF_TYPES[check_type(qtype)]
    cfg = _config(folder)
    arch = check_output(cfg)
    plan = _plan(folder, cfg, arch, want)
    emb = next((shape for hf, mapped, shape, *_ in plan if mapped == "token_embd.weight"),
               None)
    n_vocab = emb[0] if emb else int(cfg.get("vocab_size", 0))
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        w = gguf.GGUFWriter(tmp, gguf.MODEL_ARCH_NAMES[arch.arch])
        w.add_type(gguf.GGUFType.MODEL)
        w.add_name(name or folder.name)
        _hparams(w, cfg)
        w.add_vocab_size(n_vocab)
        w.add_file_type(int(file_type))
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        _vocab(w, folder, n_vocab)
        for key, value in (provenance or {}).items():
            w.add_string(f"maec.{key}", value)
        for _hf, mapped, shape, tt, _p in plan:
            w.add_tensor_info(mapped, shape, np.dtype(np.float32), _nbytes(shape, tt),
                              raw_dtype=tt)
        w.write_header_to_file(tmp)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        by_name = {hf: (tt, p) for hf, _m, _s, tt, p in plan}
        for hf, data in _tensors(folder):
            if hf not in by_name:
                continue
            tt, heads = by_name[hf]
            w.write_tensor_data(_encode(_permute(data, heads) if heads else data, tt))
        w.close()
        tmp.rename(dest)
    finally:
        tmp.unlink(missing_ok=True)
