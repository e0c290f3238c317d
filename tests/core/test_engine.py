"""The engine end to end on tiny checkpoints: loadable, checksummed, sharded, deterministic."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlamaForCausalLM

from maec_core.context import RunContext
from maec_core.engine import all_finite
from maec_core.errors import Cancelled, IncompatibleCheckpoints
from maec_core.methods import get_method
from maec_core.parsing import parse_recipe
from maec_core.run import run
from tests.core.conftest import leftovers
from tests.factories import make_llama, read_config, spy_slice_sizes


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def ta_recipe(zoo: dict[str, Path], **extra: Any) -> dict[str, Any]:
    return {
        "merge_method": "task_arithmetic",
        "base_model": str(zoo["base"]),
        "models": [{"model": str(zoo["a"]), "parameters": {"weight": 0.5}},
                   {"model": str(zoo["b"]), "parameters": {"weight": 0.5}}],
        **extra,
    }


def test_output_loads_with_transformers_and_generates(zoo: dict[str, Path],
                                                      tmp_path: Path) -> None:
    out = tmp_path / "merged"
    result = run(parse_recipe(ta_recipe(zoo, dtype="bfloat16")), out)
    assert result.tensors == len(tensors(zoo["base"]))
    model = LlamaForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("w1 w2 w3", return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=5, do_sample=False)
    assert gen.shape[1] == ids.shape[1] + 5
    # The merged weights are what the formula says (to bf16 rounding).
    want = {k: (v + 0.5 * (tensors(zoo["a"])[k] - v) + 0.5 * (tensors(zoo["b"])[k] - v))
            for k, v in tensors(zoo["base"]).items()}
    for k, v in tensors(out).items():
        torch.testing.assert_close(v.float(), want[k].to(torch.bfloat16).float(),
                                   rtol=0.016, atol=1e-3)
    cfg = read_config(out)
    assert cfg["dtype"] == "bfloat16"
    assert (out / "recipe.yaml").is_file() and (out / "README.md").is_file()


def test_manifest_lists_every_file_with_its_checksum(zoo: dict[str, Path],
                                                    tmp_path: Path) -> None:
    out = tmp_path / "merged"
    run(parse_recipe(ta_recipe(zoo, out_shard_size="40KB")), out)
    manifest = json.loads((out / "manifest.json").read_text())
    listed = {f["path"]: f for f in manifest["files"]}
    on_disk = {p.name for p in out.iterdir()} - {"manifest.json"}
    assert set(listed) == on_disk
    for name, entry in listed.items():
        data = (out / name).read_bytes()
        assert entry["size"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    base_file = zoo["base"] / "model.safetensors"
    assert manifest["inputs"][str(zoo["base"])]["files"] == {
        "model.safetensors": hashlib.sha256(base_file.read_bytes()).hexdigest()
    }
    assert manifest["total_size"] == sum(f["size"] for f in manifest["files"])


@pytest.mark.parametrize(
    ("method", "donor"),
    [("ties", {"density": 0.5}), ("dare_ties", {"density": 0.4})],
)
def test_same_recipe_gives_bit_identical_files(zoo: dict[str, Path], tmp_path: Path,
                                               method: str, donor: dict[str, Any]) -> None:
    recipe = {
        "merge_method": method,
        "base_model": str(zoo["base"]),
        "models": [{"model": str(zoo["a"]), "parameters": {"weight": 0.6, **donor}},
                   {"model": str(zoo["b"]), "parameters": {"weight": 0.6, **donor}}],
        "parameters": {"random_seed": 11} if method.startswith("dare") else {},
    }
    run(parse_recipe(recipe), tmp_path / "one")
    run(parse_recipe(recipe), tmp_path / "two")
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "two").iterdir())
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    if method == "dare_ties":
        other = dict(recipe, parameters={"random_seed": 12})
        run(parse_recipe(other), tmp_path / "three")
        a = (tmp_path / "one" / "model.safetensors").read_bytes()
        assert a != (tmp_path / "three" / "model.safetensors").read_bytes()


def test_small_shard_size_writes_an_index_transformers_loads(zoo: dict[str, Path],
                                                              tmp_path: Path) -> None:
    run(parse_recipe(ta_recipe(zoo)), tmp_path / "single")
    out = tmp_path / "sharded"
    run(parse_recipe(ta_recipe(zoo, out_shard_size="20KB")), out)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 3 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    single = tensors(tmp_path / "single")
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in single.values())
    for k, v in tensors(out).items():
        assert torch.equal(v, single[k])
    loaded = LlamaForCausalLM.from_pretrained(out)
    ref = LlamaForCausalLM.from_pretrained(tmp_path / "single")
    for (n, p), (_, q) in zip(loaded.named_parameters(), ref.named_parameters(), strict=True):
        assert torch.equal(p, q), n


def test_sharded_inputs_merge_like_single_files(zoo: dict[str, Path], tmp_path: Path) -> None:
    # The same seeds rebuild the zoo's weights, saved in several shards.
    base = make_llama(tmp_path / "base", seed=0, max_shard_size="20KB")
    a = make_llama(tmp_path / "a", seed=1, like=base, max_shard_size="30KB")
    b = make_llama(tmp_path / "b", seed=2, like=base)
    assert (base / "model.safetensors.index.json").is_file()
    assert (a / "model.safetensors.index.json").is_file()
    run(parse_recipe(ta_recipe({"base": base, "a": a, "b": b})), tmp_path / "from-shards")
    run(parse_recipe(ta_recipe(zoo)), tmp_path / "from-single")
    got, want = tensors(tmp_path / "from-shards"), tensors(tmp_path / "from-single")
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_tied_embeddings_merge(tmp_path: Path) -> None:
    base = make_llama(tmp_path / "base", seed=3, tie_word_embeddings=True)
    a = make_llama(tmp_path / "a", seed=4, like=base, tie_word_embeddings=True)
    out = tmp_path / "merged"
    run(parse_recipe({"merge_method": "ties", "base_model": str(base),
                "models": [{"model": str(a), "parameters": {"weight": 1.0, "density": 0.5}}]}),
               out)
    merged = tensors(out)
    assert "lm_head.weight" not in merged and "model.embed_tokens.weight" in merged
    assert read_config(out)["tie_word_embeddings"] is True
    model = LlamaForCausalLM.from_pretrained(out)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    model.generate(torch.tensor([[1, 5, 6]]), max_new_tokens=3, do_sample=False)


def test_shape_mismatch_names_tensor_and_shapes(zoo: dict[str, Path], tmp_path: Path) -> None:
    odd = tmp_path / "odd"
    shutil.copytree(zoo["a"], odd)
    weights = load_file(odd / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = torch.zeros(32, 48)
    save_file(weights, odd / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "merged"
    recipe = ta_recipe({**zoo, "b": odd})
    with pytest.raises(IncompatibleCheckpoints) as info:
        run(parse_recipe(recipe), out)
    msg = str(info.value)
    assert name in msg and "[32, 64]" in msg and "[32, 48]" in msg
    assert info.value.details["tensor"] == name
    assert leftovers(out) == []


def test_vocab_mismatch_says_vocab(zoo: dict[str, Path], tmp_path: Path) -> None:
    wide = make_llama(tmp_path / "wide", seed=5, vocab_size=80, tokenizer=False)
    out = tmp_path / "merged"
    with pytest.raises(IncompatibleCheckpoints, match="vocab size differs") as info:
        run(parse_recipe(ta_recipe({**zoo, "b": wide})), out)
    assert "64" in str(info.value) and "80" in str(info.value)
    assert leftovers(out) == []


def test_filter_override_applies_per_tensor(zoo: dict[str, Path], tmp_path: Path) -> None:
    recipe = {
        "merge_method": "task_arithmetic",
        "base_model": str(zoo["base"]),
        "models": [{"model": str(zoo["a"]), "parameters": {
            "weight": [{"filter": "mlp", "value": 0.0}, {"value": 1.0}]}}],
    }
    out = tmp_path / "merged"
    run(parse_recipe(recipe), out)
    got, base, a = tensors(out), tensors(zoo["base"]), tensors(zoo["a"])
    mlp = [k for k in got if ".mlp." in k]
    assert mlp
    for k, v in got.items():
        assert torch.equal(v, base[k] if ".mlp." in k else a[k]), k


def test_layer_swap_copies_whole_blocks(zoo: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "swapped"
    run(parse_recipe({"merge_method": "layer_swap",
                "models": [{"model": str(zoo["a"]), "parameters": {"role": "ability"}},
                           {"model": str(zoo["b"]), "parameters": {"role": "language"}}],
                "parameters": {"bottom_k": 1, "top_k": 0}}), out)
    got, a, b = tensors(out), tensors(zoo["a"]), tensors(zoo["b"])
    for k, v in got.items():
        from_language = ".layers.0." in k or "embed" in k
        assert torch.equal(v, b[k] if from_language else a[k]), k


def test_progress_reports_and_cancel_leaves_nothing(zoo: dict[str, Path],
                                                   tmp_path: Path) -> None:
    seen: list[tuple[str, int, int]] = []
    run(
        parse_recipe(ta_recipe(zoo)),
        tmp_path / "ok",
        RunContext(progress=lambda *a: seen.append(a)),
    )
    total = len(tensors(zoo["base"]))
    assert seen[-1] == ("merge", total, total) and len(seen) == total
    calls = iter(range(100))
    out = tmp_path / "cancelled"
    with pytest.raises(Cancelled):
        run(parse_recipe(ta_recipe(zoo)), out, RunContext(cancel=lambda: next(calls) >= 3))
    assert leftovers(out) == []


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize(
    ("method", "models", "params"),
    [
        ("task_arithmetic", [{"weight": 0.7}, {"weight": -0.2}], {"lambda": 0.9}),
        ("task_arithmetic", [{"weight": 0.7}, {"weight": 0.4}, {"weight": -0.3}],
         {"normalize": True}),
        ("linear", [{"weight": 0.3}, {"weight": 0.5}], {}),
        ("layer_swap", [{"role": "ability"}, {"role": "language"}],
         {"bottom_k": 0, "top_k": 1, "transition": 1}),
        ("nearswap", [{}], {"t": 0.01}),
        ("ram", [{}, {}], {"epsilon": 1e-3}),
        ("passthrough", [{"scale": 0.37}], {}),
    ],
)
def test_sliced_streaming_equals_whole_tensors(
    zoo: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    method: str, models: list[dict[str, Any]], params: dict[str, Any], dtype: str,
) -> None:
    """Element-wise methods stream slices in every compute dtype (16-bit ones too, on
    the CPU); with units and slices that split every tensor at odd places, the bytes
    equal a whole-tensor run's."""

    recipe: dict[str, Any] = {
        "merge_method": method,
        # A third model is the first again (with its own weight).
        "models": [{"model": str(zoo[k]), "parameters": p}
                   for k, p in zip(("a", "b", "a"), models, strict=False)],
        "parameters": params,
        "dtype": dtype,
    }
    if get_method(method).needs_base:
        recipe["base_model"] = str(zoo["base"])
    sizes = spy_slice_sizes(monkeypatch, method, unit=300, chunk=77)
    run(parse_recipe(recipe), tmp_path / "sliced")
    assert sizes and max(sizes) <= 77, f"computed whole tensors of {max(sizes)}"
    monkeypatch.setattr(type(get_method(method)), "elementwise", False)
    run(parse_recipe(recipe), tmp_path / "whole")
    assert max(sizes) > 77
    assert ((tmp_path / "sliced" / "model.safetensors").read_bytes()
            == (tmp_path / "whole" / "model.safetensors").read_bytes())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("size", [1, 7, 16, 33, 4099, 1 << 18])
def test_finiteness_check_agrees_with_isfinite(dtype: torch.dtype, size: int) -> None:
    # The engine's fast check (the extremes of each slice) must flag exactly what
    # torch.isfinite flags, wherever the bad entry sits in the vectorised loops.
    gen = torch.Generator().manual_seed(size)
    clean = torch.randn(size, generator=gen).mul_(0.02).to(dtype)
    assert all_finite(clean)
    positions = {0, size - 1, size // 2,
                 *torch.randint(size, (5,), generator=gen).tolist()}
    for pos in positions:
        for bad in (float("nan"), float("inf"), float("-inf")):
            t = clean.clone()
            t[pos] = bad
            assert all_finite(t) is bool(torch.isfinite(t).all()) is False, (pos, bad)
    assert all_finite(torch.full((size,), float("nan"), dtype=dtype)) is False
    # Finite extremes of the type itself are finite.
    assert all_finite(torch.tensor([torch.finfo(dtype).min, torch.finfo(dtype).max],
                                   dtype=dtype))


def test_finiteness_check_of_whole_and_empty_tensors() -> None:
    t = torch.randn(64, 48).to(torch.bfloat16)
    assert all_finite(t) and all_finite(t.t())  # any layout
    t[17, 5] = float("nan")
    assert not all_finite(t) and not all_finite(t.t())
    assert all_finite(torch.empty(0, 8, dtype=torch.bfloat16))


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread niceness is Linux's")
def test_compute_workers_run_behind_the_output_hash(zoo: dict[str, Path], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The threads computing slices raise their own niceness (the output's sha256, which
    cannot be split, then goes first on a busy CPU); the thread driving the merge and the
    stream's reader keep theirs."""
    from maec_core import native
    from maec_core.runtime import HELPER_NICENESS

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen: dict[str, set[int]] = {}
    kernel = native.task_arithmetic_flat

    def spy(*args: Any) -> bool | None:
        if not args[-1].numel:
            return kernel(*args)  # the empty call asking whether it takes the tensor
        seen.setdefault(threading.current_thread().name.split("_")[0], set()).add(nice())
        for t in threading.enumerate():
            if t.name == "maec-read" and t.native_id is not None:
                seen.setdefault("maec-read", set()).add(
                    os.getpriority(os.PRIO_PROCESS, t.native_id))
        return kernel(*args)

    if not native.available():
        pytest.skip("the compiled library is not built here")
    monkeypatch.setattr(native, "task_arithmetic_flat", spy)
    mine = nice()
    run(parse_recipe(ta_recipe(zoo)), tmp_path / "out", RunContext())
    assert seen == {"maec-compute": {min(19, mine + HELPER_NICENESS)}, "maec-read": {mine}}
    assert nice() == mine
