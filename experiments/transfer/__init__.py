"""The small-scale transfer experiment (``python -m experiments.transfer.run``).

One choice is made here, before anything imports torch: the CPU kernel path. At this scale
training is chaotic in the float rounding order, and torch picks its vector kernels by the
CPU (AVX-512 where present, else AVX2), so the same seed trained on two x86 machines gave
donors whose T′ accuracy differed by more than the smoke run's sanity margin (0.140 with
AVX-512 kernels, 0.275 with AVX2, same code and data; docs/experiments.md). Pinning AVX2,
which every x86-64 machine of the last decade has, makes a run's figures the same on any
of them. A value set by the caller wins, so the sensitivity itself can be measured.
"""

from __future__ import annotations

import os
import platform

if platform.machine().lower() in {"x86_64", "amd64"}:
    os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
