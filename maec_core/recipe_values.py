"""Parameter values as recipes write them: scalars, layer gradients and filter conditions.

A leaf module (pydantic only), so the method units can resolve values without importing
the recipe module, which validates recipes through them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

Scalar = float | int | bool | str
# A parameter value is a scalar, a gradient (list of numbers interpolated across layers,
# as in mergekit), or a list of {filter, value} conditions tried in order: the first
# whose filter is a substring of the tensor name wins; an entry without filter is the
# fallback. This is mergekit's syntax, so its recipes run unchanged.


class Condition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    filter: str | None = None
    value: Scalar | list[float]


# list[str] carries regex lists (MAEC's include/exclude); methods reject it by type.
ParamValue = Scalar | list[float] | list[Condition] | list[str]
