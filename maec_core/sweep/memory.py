"""What a sweep holds in memory for all its candidates' merges, within a budget.

What is held is what the method names: the input every candidate reads whole
(``held_input``) and what a reuse group's first run made (``Made.files``). For MAEC:
every candidate streams the whole language base θL (combination is θL plus sparse rows),
and the candidates of one extraction group also read the same stored ability vectors.
Held in memory (:class:`~maec_core.io.resident.ResidentFiles`, handed to each merge
through ``EngineOptions.resident``), they are read from disk once:

- θL's tensor bytes, read before the first candidate and held to the end (the winner's
  final merge included);
- then a group's ability vectors, read after the group's first candidate (which extracts
  or finds them) when a later candidate needs them, and let go after its last one.

Each only when it fits in what the budget leaves; what does not fit is read from disk
by each merge, as a lone merge reads it. The bytes are the same either way, so the
candidates' scores and the published winner are too. The leaderboard records what was
held (:class:`~maec_core.sweep.board.Residency`).

The default budget is half the memory available as the candidates start, less the
model that scores them (float32 on a CPU; on an accelerator it passes through host
memory as it loads): the other half is left to the engine's streaming buffers, the
evaluation and everything else on the machine.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path

import psutil
import torch

from maec_core.io.folder import open_model_folder
from maec_core.io.resident import ResidentFiles, held_bytes, tensor_files
from maec_core.methods.registry import get_method
from maec_core.recipe import Recipe
from maec_core.runtime import CancelFn
from maec_core.sweep.board import Residency


def default_budget(scoring_bytes: int, available: int | None = None) -> int:
    """Half of ``available`` memory (default: what the system reports now) less the
    scoring model's ``scoring_bytes``; never negative."""
    free = psutil.virtual_memory().available if available is None else available
    return max(0, free // 2 - scoring_bytes)


class SweepMemory:
    """The inputs one sweep holds in memory, and the record of what it held."""

    def __init__(self, budget: int, cancel: CancelFn | None = None) -> None:
        self.budget = budget
        self._cancel = cancel
        self._lang: ResidentFiles | None = None
        self._groups: dict[Hashable, ResidentFiles] = {}
        self.summary: Residency | None = None

    @classmethod
    def start(cls, recipe: Recipe, device: torch.device, budget: int | None,
              cancel: CancelFn | None = None) -> SweepMemory:
        """Hold ``recipe``'s language base when it fits ``budget`` (None: the default
        for scoring on ``device``). A sweep without a language base holds nothing."""
        held = get_method(recipe.merge_method).held_input(recipe)
        if held is None:
            return cls(budget or 0, cancel)
        lang = open_model_folder(held, base=recipe.base_model)
        files = tensor_files(lang.tensors)
        size = held_bytes(files)
        if budget is None:
            # The scoring model holds every tensor of a candidate (θL's names and shapes).
            numel = sum(t.numel for t in lang.tensors.values())
            per = 4 if device.type == "cpu" else max(
                (t.nbytes // max(t.numel, 1) for t in lang.tensors.values()), default=4)
            budget = default_budget(numel * per)
        memory = cls(budget, cancel)
        memory.summary = Residency(language_base=False, language_base_bytes=size,
                                   budget_bytes=budget)
        if 0 < size <= budget:
            memory._lang = ResidentFiles.read(files, cancel)
            memory.summary.language_base = True
        return memory

    @property
    def held(self) -> int:
        """Bytes held now."""
        return sum(r.nbytes for r in self._all())

    def _all(self) -> list[ResidentFiles]:
        return [r for r in (self._lang, *self._groups.values()) if r is not None]

    def hold_group(self, group: Hashable, files: list[Path]) -> None:
        """Hold what ``group``'s first run made (its ``files``: MAEC's ability vectors)
        if they fit in what the budget leaves."""
        if self.summary is None or group in self._groups:
            return
        if self.held + held_bytes(files) <= self.budget:
            self._groups[group] = ResidentFiles.read(files, self._cancel)
            self.summary.ability_vector_groups += 1

    def release_group(self, group: Hashable) -> None:
        self._groups.pop(group, None)

    def resident(self, group: Hashable | None) -> ResidentFiles | None:
        """What a merge of a candidate of ``group`` takes from memory (None: nothing)."""
        parts = [r for r in (self._lang, self._groups.get(group)) if r is not None]
        if not parts:
            return None
        out = parts[0]
        for r in parts[1:]:
            out = out | r
        return out

    def close(self) -> None:
        self._lang = None
        self._groups.clear()
