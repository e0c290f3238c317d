"""The ``sweep:`` block of a recipe or job (torch-free, no other maec_core import).

```yaml
sweep:
  grid: {key_ratio: [0.05, 0.1], mu: [0.5, 1.0, 1.5]}
  objective: {set: mgsm-sw, metric: accuracy, goal: max}
  constraint: {set: wiki-sw, metric: perplexity, max_ratio_to: language_base, value: 1.1}
  tie_break: {set: wiki-sw, metric: perplexity}
  publish: best
```

A knob is a numeric parameter of the recipe's method: a global one (``key_ratio``,
``density`` of TIES is per model, see below), a per-model one set on every model
(``weight``, ``density``), MAEC's ``mu`` set on every ability, or one entry's only:
``models[1].weight``, ``abilities[0].mu``. Every combination of the grid's values is one
candidate, in grid order (the last knob varies fastest).

Candidates are ranked by the objective; among those with the same objective value (an
accuracy on a few hundred items ties often), by ``tie_break`` when given (another
metric, in its own sense), then in grid order.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# A grid is run in full: these caps bound one job's cost before anything is queued.
MAX_KNOBS = 8
MAX_VALUES = 32
MAX_CANDIDATES = 64
# ``models[i].`` or a method's own list of entries (which lists exist, and which keys of
# their entries a sweep may vary, the methods say: maec_core.sweep.grid asks them).
KNOB_PATTERN = r"^(?:[a-z_]{1,32}\[\d{1,3}\]\.)?[A-Za-z_][A-Za-z0-9_]{0,63}$"
_KNOB = re.compile(KNOB_PATTERN)

# Our own sets' metrics, or an lm_eval set's lm-eval metric name ("acc_norm",
# "exact_match,flexible-extract"), which must be the metric that set is given.
Metric = Annotated[str, Field(min_length=1, max_length=128,
                              pattern=r"^[A-Za-z0-9_]+(?:,[A-Za-z0-9_.-]+)?$")]
# lm-eval metrics where lower is better (their default goal is min; the rest max).
LOWER_IS_BETTER = ("perplexity", "word_perplexity", "byte_perplexity", "bits_per_byte",
                   "ter")
# The inputs a ratio constraint may compare against (evaluated once per sweep).
Reference = Literal["language_base"]


class Objective(BaseModel):
    """What the winner is best at: one eval set's metric, maximised or minimised.

    ``goal`` defaults to the metric's sense: max for accuracy, min for perplexity; for
    an lm-eval metric, min for the perplexity-like ones, else max.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    set: str = Field(min_length=1, max_length=64)
    metric: Metric
    goal: Literal["max", "min"] | None = None

    @property
    def direction(self) -> Literal["max", "min"]:
        if self.goal is not None:
            return self.goal
        name = self.metric.partition(",")[0]
        return "min" if name in LOWER_IS_BETTER else "max"

    def summary(self) -> dict[str, str]:
        """As the leaderboard records it: the set, the metric and the goal in force."""
        return {"set": self.set, "metric": self.metric, "goal": self.direction}


class Constraint(BaseModel):
    """A bound every published candidate must meet on one eval set's metric.

    Either absolute (``max`` or ``min``) or relative to an input evaluated alongside
    (``max_ratio_to`` / ``min_ratio_to`` with ``value``: e.g. perplexity at most 1.1 x
    the language base's).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    set: str = Field(min_length=1, max_length=64)
    metric: Metric
    max: float | None = None
    min: float | None = None
    max_ratio_to: Reference | None = None
    min_ratio_to: Reference | None = None
    value: float | None = Field(default=None, gt=0.0)

    @model_validator(mode="after")
    def _one_bound(self) -> Constraint:
        given = [k for k in ("max", "min", "max_ratio_to", "min_ratio_to")
                 if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("a constraint takes exactly one of max, min, max_ratio_to, "
                             f"min_ratio_to (got {', '.join(given) or 'none'})")
        ratio = given[0].endswith("_ratio_to")
        if ratio and self.value is None:
            raise ValueError(f"{given[0]} needs value (the allowed ratio, e.g. 1.1)")
        if not ratio and self.value is not None:
            raise ValueError("value is the ratio of max_ratio_to/min_ratio_to; an absolute "
                             "bound is max or min alone")
        for k in ("max", "min"):
            bound = getattr(self, k)
            if bound is not None and not math.isfinite(bound):
                raise ValueError(f"{k} must be a finite number")
        return self

    @property
    def reference(self) -> Reference | None:
        return self.max_ratio_to or self.min_ratio_to

    def limit(self, reference_value: float | None) -> tuple[Literal["max", "min"], float]:
        """The bound as (sense, number); a ratio needs the reference's value."""
        if self.max is not None:
            return "max", self.max
        if self.min is not None:
            return "min", self.min
        assert self.value is not None and reference_value is not None
        sense: Literal["max", "min"] = "max" if self.max_ratio_to else "min"
        return sense, self.value * reference_value

    def describe(self, reference_value: float | None) -> str:
        sense, bound = self.limit(reference_value)
        sign = "<=" if sense == "max" else ">="
        text = f"{self.metric}({self.set}) {sign} {bound:.4g}"
        if self.reference is not None:
            text += f" ({self.value} x {self.reference})"
        return text


class SweepSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    grid: dict[str, list[int | float]] = Field(min_length=1, max_length=MAX_KNOBS)
    objective: Objective
    constraint: Constraint | None = None
    # Decides between candidates whose objective values are equal; grid order after it.
    tie_break: Objective | None = None
    # best: the winner is the job's output; all: every candidate is also published
    # under its own prefix (candidates/<id>/).
    publish: Literal["best", "all"] = "best"

    @field_validator("grid", mode="before")
    @classmethod
    def _numbers(cls, grid: object) -> object:
        # Before pydantic coerces: true/false or "0.5" are not numbers here.
        if isinstance(grid, dict):
            for knob, values in grid.items():
                if not isinstance(values, list):
                    raise ValueError(f"grid.{knob}: give a list of numbers")
                for v in values:
                    if isinstance(v, bool) or not isinstance(v, int | float):
                        raise ValueError(f"grid.{knob}: {v!r} is not a number")
        return grid

    @field_validator("grid")
    @classmethod
    def _knobs(cls, grid: dict[str, list[int | float]]) -> dict[str, list[int | float]]:
        total = 1
        for knob, values in grid.items():
            if not _KNOB.match(knob):
                raise ValueError(f"grid: {knob!r} is not a parameter name (e.g. key_ratio, "
                                 "weight, models[0].weight, abilities[1].mu)")
            if not 1 <= len(values) <= MAX_VALUES:
                raise ValueError(f"grid.{knob}: give 1 to {MAX_VALUES} values")
            if len(set(values)) != len(values):
                raise ValueError(f"grid.{knob}: a value is listed twice")
            if not all(math.isfinite(v) for v in values):
                raise ValueError(f"grid.{knob}: values must be finite numbers")
            total *= len(values)
        if total > MAX_CANDIDATES:
            raise ValueError(f"the grid has {total} candidates; a sweep runs at most "
                             f"{MAX_CANDIDATES}")
        return grid

    @property
    def size(self) -> int:
        return math.prod(len(v) for v in self.grid.values())

    def sets_used(self) -> list[str]:
        names = [self.objective.set]
        for other in (self.constraint, self.tie_break):
            if other is not None and other.set not in names:
                names.append(other.set)
        return names
