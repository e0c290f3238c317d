"""Run-time types and helpers shared by the engine, the MAEC pipeline and ``run``.

Importing this module does not import torch: the callback types and ``MergeResult`` are
used by callers (the worker's progress reporting, the CLI) that should not pay for it.
The torch-side helpers import it when called.

Every change to torch's process-wide intra-op thread count goes through
:func:`torch_threads`, so a change is always undone and two changes cannot interleave
unnoticed.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# progress(stage, done, total)
ProgressFn = Callable[[str, int, int], None]
# True when the caller wants the run to stop (checked between tensors).
CancelFn = Callable[[], bool]


@dataclass
class MergeResult:
    out_dir: Path
    manifest: dict[str, Any]
    tensors: int
    seconds: float
    stage_seconds: dict[str, float] = field(default_factory=dict)
    report: dict[str, Any] | None = None


def best_device(requested: str | None = None) -> torch.device:
    """``requested`` when given, else CUDA when present, else the CPU."""
    import torch

    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@functools.cache
def _dtype_table() -> dict[str, torch.dtype]:
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of an output dtype name (float32, float16 or bfloat16)."""
    return _dtype_table()[name]


# Serialises thread-count changes: torch's setting is process-wide, so two threads each
# saving and restoring it must not interleave their reads and writes.
_THREADS_LOCK = threading.RLock()


class ThreadControl:
    """The thread setting inside one :func:`torch_threads` block."""

    def __init__(self, saved: int) -> None:
        self.saved = saved

    def use(self, n: int) -> None:
        """Run the following torch ops on ``n`` intra-op threads (until changed or the
        block ends); a no-op when already so, as a change rebuilds the OpenMP team."""
        import torch

        with _THREADS_LOCK:
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)


@contextmanager
def torch_threads(n: int | None = None) -> Iterator[ThreadControl]:
    """Set torch's intra-op thread count to ``n`` for the block, restoring it after.

    ``n=None`` changes nothing on entry (the block may still call ``use``). The yielded
    control lets a loop change the count per step without restoring it between steps.
    """
    import torch

    with _THREADS_LOCK:
        ctl = ThreadControl(torch.get_num_threads())
    try:
        if n is not None:
            ctl.use(n)
        yield ctl
    finally:
        ctl.use(ctl.saved)


def cpu_single_thread(device: torch.device) -> AbstractContextManager[ThreadControl]:
    """One intra-op thread while computing on the CPU; nothing changes on a GPU.

    Per-slice and per-row ops are too small to split, and on a busy machine an OpenMP
    team waiting at a barrier for a descheduled member stalls every op (extraction
    measured 15x slower with 2 threads on 2 shared cores).
    """
    return torch_threads(1 if device.type == "cpu" else None)
