"""Shared tiny checkpoints for the engine tests, built once per session (never downloaded)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.factories import make_llama


@pytest.fixture(autouse=True)
def _isolated_hash_cache(tmp_path_factory: pytest.TempPathFactory,
                         monkeypatch: pytest.MonkeyPatch) -> None:
    # The input-hash cache lives under ~/.cache by default; tests must not touch it.
    monkeypatch.setenv("MAEC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "hash-cache"))


@pytest.fixture(scope="session")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A float32 base, two fine-tunes of it, and variants for the compatibility tests."""
    root = tmp_path_factory.mktemp("zoo")
    base = make_llama(root / "base", seed=0)
    models = {
        "base": base,
        "a": make_llama(root / "a", seed=1, like=base),
        "b": make_llama(root / "b", seed=2, like=base),
    }
    return models


@pytest.fixture(scope="session")
def bf16_zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bf16")
    base = make_llama(root / "base", seed=10, dtype=torch.bfloat16)
    return {
        "base": base,
        "a": make_llama(root / "a", seed=11, like=base, dtype=torch.bfloat16),
        "b": make_llama(root / "b", seed=12, like=base, dtype=torch.bfloat16),
    }


def leftovers(out_dir: Path) -> list[str]:
    """Anything a failed merge left beside (or at) ``out_dir``."""
    parent = out_dir.parent
    if not parent.exists():
        return []
    return sorted(
        p for p in os.listdir(parent) if p == out_dir.name or p.startswith(f".{out_dir.name}.")
    )
