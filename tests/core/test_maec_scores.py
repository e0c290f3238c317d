"""The row-score stream of extraction: blocks read and scored on several threads give
each tensor's scores exactly as one pass over the whole tensor, in order, and a read that
fails stops the stream with the checkpoint's error."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from maec_core.errors import CorruptCheckpoint
from maec_core.io.folder import open_model_folder
from maec_core.maec import extract
from maec_core.plan import PlannedTensor, build_plan
from tests.core.test_maec_common import (
    _private_cache,  # noqa: F401 - autouse fixture
    base_weights,
    load,
    noise_like,
    write_ckpt,
)


def _candidates(tmp_path: Path, dtype: torch.dtype) -> list[PlannedTensor]:
    w0 = base_weights(0)
    wa = {k: v + 0.01 * n for (k, v), n in zip(w0.items(), noise_like(w0, 3, 1.0).values(),
                                                strict=True)}
    base = write_ckpt(tmp_path / "base", w0, dtype)
    ability = write_ckpt(tmp_path / "ability", wa, dtype)
    plan = build_plan({"base": open_model_folder(base), "ability": open_model_folder(ability)},
                      "base")
    # Every tensor, the norms (rows of one entry) beside matrices of several blocks, so
    # blocks of different tensors are in flight at once.
    return [t for t in plan.tensors if len(t.shape) in (1, 2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_stream_equals_whole_tensor_scores(tmp_path: Path, dtype: torch.dtype,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    cands = _candidates(tmp_path, dtype)
    # Blocks of 3 rows of the widest tensor and only 3 in flight: tensors span many
    # blocks, scorers finish out of order and wait for buffer sets.
    widest = max(t.numel // t.shape[0] for t in cands)
    monkeypatch.setattr(extract, "BLOCK_ELEMS", 3 * widest)
    monkeypatch.setattr(extract, "CPU_BLOCKS_AHEAD", 3)
    ticks: list[str] = []
    got = list(extract.stream_row_scores(cands, ("ability", "base"), torch.device("cpu"),
                                         lambda: ticks.append("tick")))
    assert [t.name for t, _ in got] == [t.name for t in cands]
    assert len(ticks) == len(cands)
    wa, w0 = load(tmp_path / "ability"), load(tmp_path / "base")
    for t, scores in got:
        whole = extract.row_scores(wa[t.name].to(dtype), w0[t.name].to(dtype))
        assert torch.equal(scores, whole), t.name
        assert scores.shape == (t.shape[0],)


def test_failed_read_stops_the_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cands = _candidates(tmp_path, torch.bfloat16)
    widest = max(t.numel // t.shape[0] for t in cands)
    monkeypatch.setattr(extract, "BLOCK_ELEMS", 2 * widest)
    # The donor file loses its last bytes after it was opened: the blocks reading them
    # fail on a scoring thread; the error reaches the caller and no thread is left.
    donor = tmp_path / "ability" / "model.safetensors"
    before = threading.active_count()
    with open(donor, "r+b") as f:
        f.truncate(donor.stat().st_size - 64)
    with pytest.raises(CorruptCheckpoint, match="truncated"):
        list(extract.stream_row_scores(cands, ("ability", "base"), torch.device("cpu"),
                                       lambda: None))
    assert threading.active_count() == before
