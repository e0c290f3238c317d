"""Gathering each model's embedding / LM-head rows into the output vocabulary.

One gather per model (its own rows), one weighted sum for the default rows of tokens
some model lacks, and the padding rows: the aligned tensors the recipe's method merges.
"""

from __future__ import annotations

import torch

from maec_core.vocab.build import VocabPlan


class RowAligner:
    """``align(keys, inputs)``: each model's vocabulary tensor, rows in output order.

    Index tensors are built once per merge and reused for the embedding and the LM head.
    """

    def __init__(self, plan: VocabPlan) -> None:
        self.plan = plan
        self._n = len(plan.tokens)
        self._own: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for key, rows in plan.own.items():
            own = torch.tensor(rows, dtype=torch.long)
            at = torch.nonzero(own >= 0).flatten()
            self._own[key] = (at, own[at])
        fill_ids = torch.tensor(plan.fill_ids, dtype=torch.long)
        self._fill_ids = fill_ids
        self._fill = {k: (torch.tensor(r, dtype=torch.long), torch.tensor(w))
                      for k, (r, w) in plan.fill.items()}
        # Per model: which default rows it takes (the filled tokens it lacks).
        self._lacks: dict[str, torch.Tensor] = {}
        for key, rows in plan.own.items():
            own = torch.tensor(rows, dtype=torch.long)
            self._lacks[key] = torch.nonzero(own[fill_ids] < 0).flatten() if len(
                plan.fill_ids) else torch.empty(0, dtype=torch.long)

    def defaults(self, keys: list[str], inputs: list[torch.Tensor]) -> torch.Tensor:
        """The default row of every filled token (float32, on the inputs' device)."""
        first = inputs[0]
        out = torch.zeros((len(self.plan.fill_ids), *first.shape[1:]), dtype=torch.float32,
                          device=first.device)
        for key, x in zip(keys, inputs, strict=True):
            found = self._fill.get(key)
            if found is None:
                continue
            rows, w = found
            picked = x.index_select(0, rows.to(x.device)).float()
            out += picked * w.to(x.device).view(-1, *([1] * (x.dim() - 1)))
        return out

    def align(self, keys: list[str], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Replace each of ``inputs`` by its aligned tensor, in place (each input is let
        go as soon as its aligned copy exists: one extra tensor at a time, not all)."""
        default = self.defaults(keys, inputs)
        for i, key in enumerate(keys):
            x = inputs[i]
            y = torch.zeros((self.plan.rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
            at, src = self._own[key]
            y.index_copy_(0, at.to(x.device), x.index_select(0, src.to(x.device)))
            lacks = self._lacks[key].to(x.device)
            if lacks.numel():
                y.index_copy_(0, self._fill_ids.to(x.device)[lacks],
                              default.index_select(0, lacks).to(x.dtype))
            if self.plan.rows > self._n:
                # Padding rows: the mean of the real ones (as mergekit pads).
                y[self._n:] = y[: self._n].mean(dim=0)
            inputs[i] = y
            del x
        return inputs
