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
    # Other keys are kept and reported, not refused: mergekit 0.1.5 drops them (its
    # examples write ``pattern:``), so such a condition there matches every tensor, and a
    # recipe written for it must give its result here too. ``unread_keys`` names them.
    model_config = ConfigDict(extra="allow")

    filter: str | None = None
    value: Scalar | list[float]

    def unread_keys(self) -> list[str]:
        return sorted(self.model_extra or {})


def condition_warnings(where: str, value: object) -> list[str]:
    """One line per key a list of conditions gives that no condition reads."""
    if not isinstance(value, list):
        return []
    out = []
    for n, cond in enumerate(value):
        if not isinstance(cond, Condition):
            continue
        reach = ("so, as in mergekit, this condition matches every tensor" if cond.filter
                 is None else "the condition selects by its filter alone")
        out += [f"{where}[{n}].{key} ignored: conditions select tensors by 'filter'; {reach}"
                for key in cond.unread_keys()]
    return out


# list[str] carries regex lists (MAEC's include/exclude); methods reject it by type.
ParamValue = Scalar | list[float] | list[Condition] | list[str]
