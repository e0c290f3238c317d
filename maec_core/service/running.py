"""The front door's torch side: what merges, builds a mixture of experts, sweeps and
evaluates. The worker imports it; the API never does (it must not load torch)."""

from __future__ import annotations

from maec_core.context import RunContext
from maec_core.engine import planned_shard_count
from maec_core.gguf.dequantize import GGUF_INFO_FILE, dequantize_gguf
from maec_core.gguf.sources import check_gguf_output
from maec_core.io.writer import WrittenFile
from maec_core.methods.base import PhasedMerge
from maec_core.moe.build import build_moe
from maec_core.run import phased, run
from maec_core.runtime import EngineOptions
from maec_core.shard_reads import InputSpan, shard_reads
from maec_core.sweep.runner import SweepOptions, evaluate_folder, run_sweep

__all__ = [
           "GGUF_INFO_FILE",
           "EngineOptions",
           "InputSpan",
           "PhasedMerge",
           "RunContext",
           "SweepOptions",
           "WrittenFile",
           "build_moe",
           "check_gguf_output",
           "dequantize_gguf",
           "evaluate_folder",
           "phased",
           "planned_shard_count",
           "run",
           "run_sweep",
           "shard_reads",
]
