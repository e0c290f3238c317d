"""One stack per module: SeaweedFS S3 storage, a real Celery worker, uvicorn."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import StackFactory, TinyModels
from tests.stack import S3Server, Stack


@dataclass
class Sources:
    """The tiny checkpoints, uploaded to S3 (``s3://...``) and as local paths."""

    base: str
    donor: str
    lang: str
    lang2: str
    local: TinyModels


@pytest.fixture(scope="module")
def stack(make_module_stack: StackFactory, tiny_models: TinyModels) -> Stack:
    return make_module_stack(storage="s3", workers=1, local_roots=[tiny_models.root])


@pytest.fixture(scope="module")
def s3_sources(stack: Stack, tiny_models: TinyModels) -> Sources:
    s3: S3Server | None = stack.s3
    assert s3 is not None
    up = {n: s3.upload_folder(getattr(tiny_models, n), f"models/{n}")
          for n in ("base", "donor", "lang", "lang2")}
    return Sources(local=tiny_models, **up)


@pytest.fixture(scope="module")
def corpus(tiny_models: TinyModels) -> Path:
    """~600k words of the tiny vocabulary: a gradient pass over it takes seconds."""
    path = tiny_models.root / "corpus.txt"
    if not path.exists():
        rng = random.Random(0)
        with open(path, "w") as f:
            for _ in range(2000):
                f.write(" ".join(f"w{rng.randrange(61)}" for _ in range(300)) + "\n\n")
    return path
