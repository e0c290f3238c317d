"""Hostile checkpoints, kept as generators so every suite can offer the same attacks.

Each case copies a good tiny checkpoint and breaks it in one way. ``HOSTILE`` lists them
with the stable error code that must refuse them, the first step expected to do so
(``open``: reading the folder; ``plan``: comparing it with a good peer; ``run``: the
merge itself), and a fragment of the message that proves the intended defence fired
rather than some accidental one. Cases that carry a pickle payload set ``marker``: the
payload creates ``marker_path(folder)`` when unpickled, so a test proves it never ran by
checking that file does not exist.

Used by tests/core/test_hostile_inputs.py (the library) and tests/reliability (over HTTP).
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Stage = Literal["open", "plan", "run"]


def marker_path(folder: Path) -> Path:
    """The file a case's pickle payload would create: beside the folder, never inside it."""
    return folder.parent / f"{folder.name}.PAYLOAD-RAN"


def outside_dir(folder: Path) -> Path:
    """Where a case keeps files its links point to (outside the checkpoint folder)."""
    d = folder.parent / f"{folder.name}.outside"
    d.mkdir(parents=True, exist_ok=True)
    return d


class Payload:
    """Unpickling this calls ``open(marker, "w")``: harmless, but it is code execution, and
    it leaves evidence. ``pickle.loads(payload_bytes(m))`` creates ``m``."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.marker, "w"))


def payload_bytes(marker: Path) -> bytes:
    return pickle.dumps({"model.embed_tokens.weight": Payload(marker)}, protocol=4)


def torch_zip_bytes(marker: Path) -> bytes:
    """The layout torch.save writes (a zip holding data.pkl), with the payload inside."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("archive/data.pkl", payload_bytes(marker))
        z.writestr("archive/version", "3\n")
    return buf.getvalue()


# -- raw safetensors editing (no torch: the point is to write what torch never would) --


def read_raw(path: Path) -> tuple[dict[str, Any], bytes]:
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


def write_raw(path: Path, header: dict[str, Any] | bytes, data: bytes,
              *, length: int | None = None) -> None:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)


def _copy(good: Path, dst: Path) -> Path:
    shutil.copytree(good, dst, symlinks=True)
    return dst


def _weights(dst: Path) -> Path:
    return dst / "model.safetensors"


def _tensors_by_offset(header: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    entries = [(k, v) for k, v in header.items() if k != "__metadata__"]
    return sorted(entries, key=lambda kv: kv[1]["data_offsets"][0])


def _edit_tensor(dst: Path, name: str, edit: Callable[[Any], Any]) -> None:
    """Rewrite one tensor through torch (shape/dtype/value changes a real tool could make)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(_weights(dst))
    tensors[name] = edit(tensors[name])
    save_file(tensors, _weights(dst), metadata={"format": "pt"})


def _edit_config(dst: Path, **changes: Any) -> None:
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))


TARGET = "model.layers.0.mlp.down_proj.weight"


# -- the cases -------------------------------------------------------------------------


def pickle_only(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    _weights(dst).unlink()
    (dst / "pytorch_model.bin").write_bytes(payload_bytes(marker_path(dst)))
    return dst


def pickle_shard_in_index(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    header, _ = read_raw(_weights(dst))
    _weights(dst).unlink()
    shard = "pytorch_model-00001-of-00001.bin"
    (dst / shard).write_bytes(payload_bytes(marker_path(dst)))
    weight_map = {k: shard for k in header if k != "__metadata__"}
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return dst


def pickle_named_safetensors(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    _weights(dst).write_bytes(payload_bytes(marker_path(dst)))
    return dst


def torch_zip_named_safetensors(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    _weights(dst).write_bytes(torch_zip_bytes(marker_path(dst)))
    return dst


def truncated(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    blob = _weights(dst).read_bytes()
    _weights(dst).write_bytes(blob[: len(blob) * 6 // 10])
    return dst


def shorter_than_length_prefix(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    _weights(dst).write_bytes(b"\x10\x00\x00")
    return dst


def overlapping_offsets(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    header, data = read_raw(_weights(dst))
    # Two tensors of identical dtype and shape, so the size check passes and only the
    # overlap check can catch the second pointing at the first one's bytes.
    seen: dict[tuple[str, tuple[int, ...]], str] = {}
    for name, entry in _tensors_by_offset(header):
        key = (entry["dtype"], tuple(entry["shape"]))
        if key in seen:
            entry["data_offsets"] = list(header[seen[key]]["data_offsets"])
            break
        seen[key] = name
    else:
        raise AssertionError("no two tensors share a dtype and shape")
    write_raw(_weights(dst), header, data)
    return dst


def out_of_file_offsets(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    header, data = read_raw(_weights(dst))
    _, entry = _tensors_by_offset(header)[-1]
    begin, end = entry["data_offsets"]
    entry["data_offsets"] = [begin + 1_000_000, end + 1_000_000]
    write_raw(_weights(dst), header, data)
    return dst


def absurd_header_size(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    header, data = read_raw(_weights(dst))
    write_raw(_weights(dst), header, data, length=2**63)
    return dst


def header_past_end_of_file(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    header, data = read_raw(_weights(dst))
    write_raw(_weights(dst), header, data, length=50_000_000)
    return dst


def header_not_json(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    header, data = read_raw(_weights(dst))
    n = len(json.dumps(header).encode())
    write_raw(_weights(dst), b"\xff" * n, data)
    return dst


def header_huge_integer(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    header, data = read_raw(_weights(dst))
    raw = json.dumps(header).encode()
    # A shape dimension longer than Python's int_max_str_digits: json raises a bare
    # ValueError, not JSONDecodeError.
    first = _tensors_by_offset(header)[0][1]
    old = json.dumps(first["shape"]).encode()
    raw = raw.replace(old, b"[1" + b"0" * 5000 + b"]", 1)
    write_raw(_weights(dst), raw, data)
    return dst


def empty_checkpoint(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    write_raw(_weights(dst), {"__metadata__": {"format": "pt"}}, b"")
    return dst


def config_json_bomb_size(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["padding"] = "x" * (17 * 1024 * 1024)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def config_json_bomb_nesting(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    depth = 200_000
    (dst / "config.json").write_text('{"a": ' + "[" * depth + "]" * depth + "}")
    return dst


def config_json_bomb_integer(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    text = (dst / "config.json").read_text()
    cfg = json.loads(text)
    (dst / "config.json").write_text(
        text.replace(f'"vocab_size": {cfg["vocab_size"]}', '"vocab_size": 1' + "0" * 100_000)
    )
    assert "0" * 100_000 in (dst / "config.json").read_text()
    return dst


def config_wrong_types(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    _edit_config(dst, num_hidden_layers="2; rm -rf /")
    return dst


def quantized_int8(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    _edit_tensor(dst, TARGET, lambda t: (t * 100).round().clamp(-128, 127).to(dtype=_int8()))
    return dst


def _int8() -> Any:
    import torch

    return torch.int8


def mismatched_shapes(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    _edit_tensor(dst, TARGET, lambda t: t[:, :-1].contiguous())
    return dst


def vocab_mismatch(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    cfg = json.loads((dst / "config.json").read_text())
    _edit_config(dst, vocab_size=cfg["vocab_size"] + 1)
    return dst


def nan_weights(good: Path, dst: Path) -> Path:
    _copy(good, dst)

    def poison(t: Any) -> Any:
        t = t.clone()
        t[0, 0] = float("nan")
        return t

    _edit_tensor(dst, TARGET, poison)
    return dst


def inf_weights(good: Path, dst: Path) -> Path:
    _copy(good, dst)

    def poison(t: Any) -> Any:
        t = t.clone()
        t[-1, -1] = float("inf")
        return t

    _edit_tensor(dst, TARGET, poison)
    return dst


def symlink_shard_out(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    target = outside_dir(dst) / "model.safetensors"
    shutil.move(_weights(dst), target)
    _weights(dst).symlink_to(target)
    return dst


def symlink_config_out(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    target = outside_dir(dst) / "config.json"
    shutil.move(dst / "config.json", target)
    (dst / "config.json").symlink_to(target)
    return dst


def symlink_index_out(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    header, _ = read_raw(_weights(dst))
    target = outside_dir(dst) / "model.safetensors.index.json"
    weight_map = {k: "model.safetensors" for k in header if k != "__metadata__"}
    target.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (dst / "model.safetensors.index.json").symlink_to(target)
    return dst


def symlink_tokenizer_out(good: Path, dst: Path) -> Path:
    """tokenizer.json pointing at a secret: copying side files would publish it."""
    _copy(good, dst)
    secret = outside_dir(dst) / "secret.json"
    secret.write_text('{"aws_secret_access_key": "hostile-test-secret"}')
    (dst / "tokenizer.json").unlink(missing_ok=True)
    (dst / "tokenizer.json").symlink_to(secret)
    return dst


def _index_to(dst: Path, shard: str) -> None:
    header, _ = read_raw(_weights(dst))
    weight_map = {k: shard for k in header if k != "__metadata__"}
    (dst / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )


def dotdot_shard_name(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    out = outside_dir(dst)
    _index_to(dst, f"../{out.name}/model.safetensors")
    shutil.move(_weights(dst), out / "model.safetensors")
    return dst


def absolute_shard_name(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    out = outside_dir(dst)
    _index_to(dst, str((out / "model.safetensors").resolve()))
    shutil.move(_weights(dst), out / "model.safetensors")
    return dst


def tokenizer_json_is_pickle(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    (dst / "tokenizer.json").write_bytes(payload_bytes(marker_path(dst)))
    return dst


def tokenizer_model_is_torch_zip(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    (dst / "tokenizer.model").write_bytes(torch_zip_bytes(marker_path(dst)))
    return dst


def tokenizer_config_not_json(good: Path, dst: Path) -> Path:
    _copy(good, dst)
    (dst / "tokenizer_config.json").write_bytes(b"\x00\x01\x02 not json at all")
    return dst


def _adapter(good: Path, dst: Path, **config: Any) -> Path:
    """An adapter folder on ``good`` (LoRA A and B on one projection of layer 0)."""
    dst.mkdir(parents=True)
    doc = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
           "base_model_name_or_path": str(good), **config}
    (dst / "adapter_config.json").write_text(json.dumps(doc))
    return dst


def pickle_adapter(good: Path, dst: Path) -> Path:
    _adapter(good, dst)
    (dst / "adapter_model.bin").write_bytes(payload_bytes(marker_path(dst)))
    return dst


def write_lora_file(dst: Path, a_shape: list[int], b_shape: list[int]) -> None:
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    shapes = {f"{prefix}.lora_A.weight": a_shape, f"{prefix}.lora_B.weight": b_shape}
    header: dict[str, Any] = {}
    at = 0
    for name, shape in shapes.items():
        n = 4 * shape[0] * shape[1]
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [at, at + n]}
        at += n
    write_raw(dst / "adapter_model.safetensors", header, bytes(at))


def dora_adapter(good: Path, dst: Path) -> Path:
    _adapter(good, dst, use_dora=True)
    write_lora_file(dst, [2, 32], [32, 2])
    return dst


@dataclass(frozen=True)
class Hostile:
    name: str
    build: Callable[[Path, Path], Path]
    code: str
    stage: Stage
    hint: str
    marker: bool = False


HOSTILE: tuple[Hostile, ...] = (
    Hostile("pickle_only", pickle_only, "pickle_refused", "open", "pickle", marker=True),
    Hostile("pickle_shard_in_index", pickle_shard_in_index, "pickle_refused", "open",
            "pickle", marker=True),
    Hostile("pickle_named_safetensors", pickle_named_safetensors, "corrupt_checkpoint",
            "open", "header length", marker=True),
    Hostile("torch_zip_named_safetensors", torch_zip_named_safetensors, "corrupt_checkpoint",
            "open", "header length", marker=True),
    Hostile("truncated", truncated, "corrupt_checkpoint", "open", "data buffer"),
    Hostile("shorter_than_length_prefix", shorter_than_length_prefix, "corrupt_checkpoint",
            "open", "shorter than"),
    Hostile("overlapping_offsets", overlapping_offsets, "corrupt_checkpoint", "open",
            "overlaps"),
    Hostile("out_of_file_offsets", out_of_file_offsets, "corrupt_checkpoint", "open",
            "outside"),
    Hostile("absurd_header_size", absurd_header_size, "corrupt_checkpoint", "open", "cap"),
    Hostile("header_past_end_of_file", header_past_end_of_file, "corrupt_checkpoint", "open",
            "past the end"),
    Hostile("header_not_json", header_not_json, "corrupt_checkpoint", "open", "not valid JSON"),
    Hostile("header_huge_integer", header_huge_integer, "corrupt_checkpoint", "open",
            "not valid JSON"),
    Hostile("empty_checkpoint", empty_checkpoint, "corrupt_checkpoint", "open", "no tensors"),
    Hostile("config_json_bomb_size", config_json_bomb_size, "corrupt_checkpoint", "open",
            "byte cap"),
    Hostile("config_json_bomb_nesting", config_json_bomb_nesting, "corrupt_checkpoint", "open",
            "not valid JSON"),
    Hostile("config_json_bomb_integer", config_json_bomb_integer, "corrupt_checkpoint", "open",
            "not valid JSON"),
    Hostile("config_wrong_types", config_wrong_types, "corrupt_checkpoint", "open",
            "num_hidden_layers"),
    Hostile("quantized_int8", quantized_int8, "unsupported_dtype", "plan", "I8"),
    Hostile("mismatched_shapes", mismatched_shapes, "incompatible_checkpoints", "plan",
            "shape"),
    Hostile("vocab_mismatch", vocab_mismatch, "incompatible_checkpoints", "plan", "vocab size"),
    Hostile("nan_weights", nan_weights, "non_finite_output", "run", "NaN or inf"),
    Hostile("inf_weights", inf_weights, "non_finite_output", "run", "NaN or inf"),
    Hostile("symlink_shard_out", symlink_shard_out, "invalid_source", "open", "link out"),
    Hostile("symlink_config_out", symlink_config_out, "invalid_source", "open", "link out"),
    Hostile("symlink_index_out", symlink_index_out, "invalid_source", "open", "link out"),
    Hostile("symlink_tokenizer_out", symlink_tokenizer_out, "invalid_source", "open",
            "link out"),
    Hostile("dotdot_shard_name", dotdot_shard_name, "invalid_source", "open",
            "not a plain file name"),
    Hostile("absolute_shard_name", absolute_shard_name, "invalid_source", "open",
            "not a plain file name"),
    Hostile("tokenizer_json_is_pickle", tokenizer_json_is_pickle, "corrupt_checkpoint", "open",
            "not what its name claims", marker=True),
    Hostile("tokenizer_model_is_torch_zip", tokenizer_model_is_torch_zip, "corrupt_checkpoint",
            "open", "not what its name claims", marker=True),
    Hostile("tokenizer_config_not_json", tokenizer_config_not_json, "corrupt_checkpoint",
            "open", "not a JSON object"),
    Hostile("pickle_adapter", pickle_adapter, "pickle_refused", "open", "pickle",
            marker=True),
    Hostile("dora_adapter", dora_adapter, "unsupported_adapter", "open", "use_dora"),
)

BY_NAME = {h.name: h for h in HOSTILE}


# -- sources that name the service's own storage ------------------------------------------
# A tenant who knows another's job id (ids are not secrets) tries to read that job's
# published files as an input. ``Spelling``: one way of writing the address, and the code
# that must refuse it (source_forbidden where the service recognises its own storage,
# invalid_source where the string is not a valid source at all).


@dataclass(frozen=True)
class Spelling:
    name: str
    source: str
    code: str


def service_bucket_spellings(bucket: str, job_id: str, endpoint_host: str,
                             region: str = "us-east-1") -> tuple[Spelling, ...]:
    """``s3://`` spellings of job ``job_id``'s published prefix in the service's bucket."""
    prefix = f"jobs/{job_id}/a1"
    forbidden = "source_forbidden"
    encoded = "".join(f"%{ord(c):02X}" for c in bucket[:2]) + bucket[2:]
    return (
        Spelling("prefix", f"s3://{bucket}/{prefix}", forbidden),
        Spelling("one_file", f"s3://{bucket}/{prefix}/model.safetensors", forbidden),
        Spelling("trailing_slash", f"s3://{bucket}/{prefix}/", forbidden),
        Spelling("leading_slashes", f"s3://{bucket}//{prefix}", forbidden),
        Spelling("job_root", f"s3://{bucket}/jobs/{job_id}", forbidden),
        Spelling("artifacts", f"s3://{bucket}/artifacts", forbidden),
        Spelling("key_percent_encoded", f"s3://{bucket}/jobs%2F{job_id}%2Fa1", forbidden),
        Spelling("virtual_host_endpoint", f"s3://{bucket}.{endpoint_host}/{prefix}",
                 forbidden),
        Spelling("virtual_host_aws", f"s3://{bucket}.s3.amazonaws.com/{prefix}", forbidden),
        Spelling("virtual_host_region", f"s3://{bucket}.s3.{region}.amazonaws.com/{prefix}",
                 forbidden),
        Spelling("upper_case", f"s3://{bucket.upper()}/{prefix}", "invalid_source"),
        Spelling("percent_encoded_bucket", f"s3://{encoded}/{prefix}", "invalid_source"),
        Spelling("dotdot_from_another_prefix", f"s3://{bucket}/models/../{prefix}",
                 "invalid_source"),
        Spelling("dotdot_from_another_bucket", f"s3://team-models/x/../../{bucket}/{prefix}",
                 "invalid_source"),
    )


def service_dir_spellings(storage_dir: Path, work_dir: Path, root: Path, job_id: str
                          ) -> tuple[Spelling, ...]:
    """Local paths into the service's storage and work directories, for a service whose
    allowed local ``root`` contains them (a link to the storage is made under ``root``)."""
    published = storage_dir / "jobs" / job_id / "a1"
    link = root / f"innocent-{job_id}"
    if not link.is_symlink():
        link.symlink_to(published, target_is_directory=True)
    forbidden = "source_forbidden"
    return (
        Spelling("published_folder", str(published), forbidden),
        Spelling("published_file", str(published / "model.safetensors"), forbidden),
        Spelling("double_slashes", str(storage_dir) + f"//jobs//{job_id}//a1", forbidden),
        Spelling("storage_root", str(storage_dir), forbidden),
        Spelling("work_cache", str(work_dir / "cache"), forbidden),
        Spelling("link_into_storage", str(link), forbidden),
        Spelling("dotdot", f"{root}/models/../{published.relative_to(root)}",
                 "invalid_source"),
    )


def in_every_role(src: str, base: str, donor: str, lang: str, qa_set: str
                  ) -> dict[str, dict[str, Any]]:
    """Job bodies that read ``src`` in each input role (checkpoint, recipe model at weight
    1.0, base model, LoRA adapter, tokenizer donor, eval set, few-shot file, ability
    corpus, MoE expert and base, a sweep's eval set); ``base``/``donor``/``lang`` are good
    checkpoints and ``qa_set`` a good question-answer eval set for the other places."""
    evaluate = [{"name": "e", "language": "sw", "kind": "perplexity", "path": src}]
    sweep = {"grid": {"weight": [0.5, 1.0]},
             "objective": {"set": "e", "metric": "perplexity"}}
    named = {"method": "task_arithmetic", "base": base, "ability_donor": [donor],
             "language_base": lang}
    moe = {"gate_mode": "random",
           "experts": [{"source_model": donor, "positive_prompts": ["a"]},
                       {"source_model": lang, "positive_prompts": ["b"]}]}
    return {
        "ability_donor": {**named, "ability_donor": [src]},
        "language_base": {**named, "language_base": src},
        "recipe_model": {"recipe": {"merge_method": "linear", "models": [
            {"model": src, "parameters": {"weight": 1.0}}]}},
        "base_model": {"recipe": {"merge_method": "task_arithmetic", "base_model": src,
                                  "models": [{"model": donor,
                                              "parameters": {"weight": 1.0}}]}},
        "lora_adapter": {"recipe": {"merge_method": "linear",
                                    "models": [{"model": f"{base}+{src}",
                                                "parameters": {"weight": 1.0}}]}},
        "tokenizer_donor": {"recipe": {"merge_method": "linear", "tokenizer_source": src,
                                       "models": [
                                           {"model": lang, "parameters": {"weight": 1.0}},
                                           {"model": src, "parameters": {"weight": 0.0}}]}},
        "eval_set": {**named, "evaluate": evaluate},
        "few_shot": {**named, "evaluate": [{**evaluate[0], "path": qa_set,
                                            "kind": "accuracy",
                                            "few_shot": {"path": src, "k": 1,
                                                         "language": "target",
                                                         "format": "jsonl"}}]},
        "ability_corpus": {"method": "maec", "base": base, "ability_donor": [donor],
                           "language_base": lang, "ability_corpus": src,
                           "parameters": {"importance": "gradient"}},
        "moe_expert": {"kind": "moe", "recipe": {**moe, "base_model": base, "experts": [
            moe["experts"][0], {"source_model": src, "positive_prompts": ["b"]}]}},
        "moe_base": {"kind": "moe", "recipe": {**moe, "base_model": src}},
        "sweep_eval_set": {**named, "evaluate": evaluate, "sweep": sweep},
    }


# -- hostile job bodies ------------------------------------------------------------------
# What a body's JSON can carry that the service can neither store nor send back: a lone
# UTF-16 surrogate (a ``\ud800`` escape decodes to a str no UTF-8 encoder takes) and deep
# nesting. Every variant must be refused with 422 ``invalid_request`` before any job
# exists (docs/api.md, "Text and nesting").

LONE_SURROGATE = "\ud800"
# app.api.bounds.MAX_BODY_DEPTH, restated: the tests hold the documented figure.
MAX_BODY_DEPTH = 32


def _walk(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], Any]]:
    """Every (path, value) of a JSON document, containers and leaves, root first."""
    out = [(path, value)]
    items = (value.items() if isinstance(value, dict)
             else enumerate(value) if isinstance(value, list) else ())
    for k, v in items:
        out += _walk(v, (*path, k))
    return out


def _edit(doc: Any, path: tuple[Any, ...], change: Callable[[Any], Any]) -> Any:
    """A deep copy of ``doc`` with the value at ``path`` replaced by ``change(value)``."""
    copy = json.loads(json.dumps(doc))
    if not path:
        return change(copy)
    holder = copy
    for p in path[:-1]:
        holder = holder[p]
    holder[path[-1]] = change(holder[path[-1]])
    return copy


def _where(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path) or "(body)"


def surrogate_bodies(body: dict[str, Any]) -> list[tuple[str, Any]]:
    """``body`` once per string and once per object key in it, with a lone surrogate put
    into that one string or key: ``(where, body)``, every position of the body."""
    out: list[tuple[str, Any]] = []
    for path, value in _walk(body):
        if isinstance(value, str):
            out.append((f"value {_where(path)}",
                        _edit(body, path, lambda s: s[:1] + LONE_SURROGATE + s[1:])))
        if isinstance(value, dict):
            for key in value:
                out.append((f"key {_where((*path, key))}",
                            _edit(body, path, _key_marker(key))))
    return out


def _key_marker(key: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    """An edit that puts a lone surrogate into the object key ``key``, order kept."""
    return lambda d: {(k + LONE_SURROGATE if k == key else k): v for k, v in d.items()}


def nested(levels: int) -> Any:
    """A value whose containers nest ``levels`` deep (objects and arrays alternating)."""
    value: Any = "x"
    for i in range(levels):
        value = {"n": value} if i % 2 else [value]
    return value


def deep_bodies(body: dict[str, Any], levels: int = 300) -> list[tuple[str, Any]]:
    """``body`` once per object and array in it, with a value nested ``levels`` deep
    added there (an extra key of an object, an extra item of an array)."""
    out: list[tuple[str, Any]] = []
    for path, value in _walk(body):
        if isinstance(value, dict):
            out.append((f"object {_where(path)}",
                         _edit(body, path, lambda d: {**d, "deep_extra": nested(levels)})))
        elif isinstance(value, list):
            out.append((f"array {_where(path)}",
                         _edit(body, path, lambda a: [*a, nested(levels)])))
    return out


def raw_surrogate_body(body: dict[str, Any], path: tuple[Any, ...]) -> bytes:
    """``body`` as bytes with a lone surrogate as raw (CESU-style) UTF-8 bytes, not as an
    escape, in the string at ``path``: Python's JSON reader accepts those too."""
    marked = _edit(body, path, lambda s: s + "@@SURROGATE@@")
    return json.dumps(marked).encode().replace(b"@@SURROGATE@@", b"\xed\xa0\x80")
