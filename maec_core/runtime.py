"""Run-time types and helpers shared by the engine, the MAEC pipeline and ``run``.

Importing this module does not import torch: the callback types and ``MergeResult`` are
used by callers (the worker's progress reporting, the CLI) that should not pay for it.
The torch-side helpers import it when called.

Every change to torch's process-wide intra-op thread count goes through
:func:`torch_threads`, so a change is always undone and two changes cannot interleave
unnoticed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from maec_core.io.resident import ResidentFiles
    from maec_core.io.writer import ShardFn, ShardOpenFn, SinkFn, WrittenFile

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


# Compute dtypes a merge may run its arithmetic in.
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# GPU memory the engine plans to hold at most (see EngineOptions).
GPU_BUDGET_BYTES = 8 << 30


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs a merge (never what it computes, except ``compute_dtype``).

    ``compute_dtype``: the dtype the arithmetic runs in. ``None`` (the default) means
    mergekit's rule: the recipe's ``dtype`` (mergekit documents it as the dtype used for
    merging; ``out_dtype`` is the one written), else the inputs' own dtype, so a recipe
    written for mergekit gives mergekit's tensors. ``float32`` is float32 accumulation
    whatever the recipe says: the same on every device, and more precise than a bf16
    recipe's arithmetic (bf16 keeps 8 significant bits, so a sum of small task vectors
    into a large weight loses most of them); choose it where precision matters more
    than reproducing mergekit. ``bfloat16`` and ``float16`` halve the GPU memory and
    traffic of the compute. MAEC always computes in float32 (its own pipeline: its
    statistics are sums over whole tensors), whatever this says.

    ``on_shard(path, written)``: called as each output shard is complete on disk, while
    the merge goes on (the worker uploads it meanwhile). ``path`` lies in the staging
    folder, which is renamed at the end: open it in the callback to read it later.
    ``on_shard_open(path, name, size)``: called as each shard is created, with its final
    size, so its bytes can be read (uploaded) as they are appended, before it is done.

    ``sink(tensors)``: where the merged tensors go instead of a checkpoint folder (a
    sweep puts each candidate straight into the model that scores it). With a sink
    nothing is written at the output path (no shards, config, card or manifest, and the
    inputs are not hashed), so the shard callbacks are not called; the arithmetic and
    the bytes the sink receives are those the folder's shards would hold.

    ``skeleton`` (with ``sink`` only): a folder, not yet existing, that the merge writes
    its model-definition files to before it makes the sink: config.json,
    generation_config.json and the tokenizer files, the very bytes the output folder
    would hold beside its weights, and nothing else (no weights, card, recipe or
    manifest). What a sink building the model the tensors go into reads to build it.

    ``resident``: input files held in memory (:class:`maec_core.io.resident.ResidentFiles`,
    their bytes as on disk): the merge takes those files' tensors from there instead of
    reading them, and reads every other input as usual. Same bytes, same result; a sweep
    passes its language base this way, read once for all its candidates. The held bytes
    stay in CPU memory whatever the device (a CUDA merge copies them into its pinned
    buffers, as it does what it reads).

    ``done_shards`` (a folder's merge, not a sink's): output shards an earlier,
    interrupted run of the same merge already made and the caller has verified (shard
    file name -> its size and sha256). Their tensors are neither read nor computed and
    their files are not written; the output's file list and manifest name them as
    given, so the folder holds the other files and, with the given shards put beside
    them, is the uninterrupted run's byte for byte (the shard plan is fixed by the
    tensors and ``out_shard_size``). A given shard whose size is not the planned one is
    made again. ``on_shard`` and ``on_shard_open`` are called for the shards made only.

    ``part`` (a folder's merge): ``(lo, hi)``, the shards ``lo`` to ``hi - 1`` (0-based)
    of the output's fixed shard plan, the only ones this run makes: one part of a merge
    split across workers. Only those shards' tensors are read and computed, and no index
    is written (:func:`maec_core.io.writer.shard_index` gives its bytes); the folder's
    other files and its manifest describe this part only. The parts' shards together
    are the unsplit merge's, byte for byte.

    ``present`` (inputs held only in part: a part of a split merge, or a resumed
    attempt, that fetched only the byte ranges it reads): whether bytes ``[start, end)``
    of an input file are present. Every input tensor the run is to read must be, or the
    run raises ``InputRangeMissing`` before it reads any; an input file not present
    whole is not hashed for the run's manifest (its digest is the caller's to give).
    None: every input is whole.

    ``phase_records`` (a split merge whose method decides something over the whole model,
    :meth:`maec_core.methods.base.MergeMethod.phased`): what was decided once, before
    and between the parts' phases (MAEC: the ability vectors and the tensor selection);
    the merge uses them instead of deciding again, so every part, and the final step
    that writes the index, card and report, merges as the unsplit run would.

    ``gpu_budget_bytes``: the GPU memory the merge is planned to fit in. The arithmetic,
    for inputs of ``k`` models, compute itemsize ``c`` (4 for float32) and stored
    itemsize ``s`` (2 for bf16):

    - element-wise methods stream units of ``U = 2**24`` elements. Per unit in flight the
      GPU holds the raw inputs (``k*U*s``), their compute-dtype copies (``k*U*c``) and
      the result before and after the cast (``U*(c+s)``); two units are in flight (one
      copying in while one computes). For ``k = 3``, bf16 in, float32 compute:
      ``2 * (3*32 + 3*64 + 64 + 32) MB = 768 MB`` whatever the model's size, so a 70B
      merge needs no more than a 1B one.
    - whole-tensor methods (TIES, SLERP, ...) hold one tensor of ``n`` elements: ``k*n*c``
      for the inputs, about as much again for the method's temporaries and ``n*c`` for
      the result, so about ``(2k+1)*n*c`` (:func:`whole_tensor_bytes`). For a 70B Llama
      and ``k = 3`` in float32, an MLP matrix (28672 x 8192 = 2.35e8 elements) needs
      6.6 GB and the embedding or output head (128256 x 8192 = 1.05e9) 29 GB. A tensor
      over the budget is computed on the CPU instead (same float32 arithmetic), so with
      the 8 GiB default every layer of a 70B merge runs on the GPU and the two vocabulary
      matrices on the CPU, and the GPU never holds more than 8 GiB.
    """

    compute_dtype: str | None = None
    on_shard: ShardFn | None = None
    on_shard_open: ShardOpenFn | None = None
    gpu_budget_bytes: int = GPU_BUDGET_BYTES
    sink: SinkFn | None = None
    resident: ResidentFiles | None = None
    skeleton: Path | None = None
    done_shards: Mapping[str, WrittenFile] | None = None
    part: tuple[int, int] | None = None
    present: Callable[[Path, int, int], bool] | None = None
    phase_records: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.skeleton is not None and self.sink is None:
            from maec_core.errors import MaecError

            # A folder output holds these files already; only a sink lacks them.
            raise MaecError("EngineOptions.skeleton goes with a sink: a merge into a "
                            "folder writes its definition files there")
        if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
            from maec_core.errors import RecipeError

            raise RecipeError(f"compute_dtype must be one of {list(COMPUTE_DTYPES)}, "
                              f"not {self.compute_dtype!r}", compute_dtype=self.compute_dtype)


def compute_dtype_for(options: EngineOptions, recipe_dtype: str | None, input_dtype: str,
                      float32_only: bool = False) -> str:
    """The dtype a merge computes in: the option when set; float32 for a method that
    computes only in it (MAEC); otherwise the recipe's ``dtype`` or, without one, the
    inputs' (mergekit's compute dtype)."""
    if options.compute_dtype is not None:
        return options.compute_dtype
    if float32_only:
        return "float32"
    chosen = recipe_dtype or input_dtype
    return chosen if chosen in COMPUTE_DTYPES else "float32"


def whole_tensor_bytes(numel: int, inputs: int, compute_itemsize: int) -> int:
    """GPU bytes a whole-tensor merge of ``inputs`` tensors of ``numel`` elements needs
    (the ``(2k+1)*n*c`` of :class:`EngineOptions`)."""
    return (2 * inputs + 1) * numel * compute_itemsize


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


# How much nicer than the rest of the merge its compute threads run (Linux).
HELPER_NICENESS = 8


def as_helper_thread() -> None:
    """Run the calling thread behind the merge's others when the CPU is short:
    on Linux its own nice value goes up by ``HELPER_NICENESS``; elsewhere nothing changes.

    On a CPU merge the output's sha256 is the one step that cannot be shared between
    cores (one stream per file), and the compute threads have more than the other core's
    worth of work: when they pre-empt the hashing thread, the merge waits for it at the
    end. Niceness lets the hash run whenever both are ready (the 0.85B task arithmetic of
    ``bench.engine``: 0.1-0.3 s off a 1.6-2.0 s merge). The reader keeps its priority:
    when the inputs come from the disk, a late read leaves the disk idle. Raising
    niceness needs no privilege; these threads end with the merge, so it is never
    lowered again.
    """
    if sys.platform != "linux":
        return
    tid = threading.get_native_id()
    with contextlib.suppress(OSError):
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + HELPER_NICENESS))


def cpu_single_thread(device: torch.device) -> AbstractContextManager[ThreadControl]:
    """One intra-op thread while computing on the CPU; nothing changes on a GPU.

    Per-slice and per-row ops are too small to split, and on a busy machine an OpenMP
    team waiting at a barrier for a descheduled member stalls every op (extraction
    measured 15x slower with 2 threads on 2 shared cores).
    """
    return torch_threads(1 if device.type == "cpu" else None)
