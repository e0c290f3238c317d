"""What other installed distributions add to the client, found by entry point.

The client imports nothing of the merge library or the service; a distribution that has
more to offer registers it under these groups (the root ``maec-service`` distribution
does), and the client finds it with importlib.metadata at the moment it is needed:

``maec.commands``       click commands added to the ``maec`` script (``merge``, ...).
``maec.recipe_checks``  callables taking a recipe mapping; on an invalid recipe they raise
                        an exception with ``code``, ``message`` and ``details`` (the
                        service's error body), so a submit fails locally with the code
                        the service would answer. With none installed, the service checks.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint, entry_points
from typing import Any

from maec_client.errors import ValidationFailed

COMMANDS = "maec.commands"
RECIPE_CHECKS = "maec.recipe_checks"

RecipeCheck = Callable[[dict[str, Any]], object]


def registered(group: str) -> dict[str, EntryPoint]:
    """The group's entry points by name (importlib.metadata already drops duplicates of
    one distribution found twice on the path)."""
    return {ep.name: ep for ep in entry_points(group=group)}


@functools.cache
def recipe_checks() -> tuple[RecipeCheck, ...]:
    # Loaded once per process: a check may import a sizeable library.
    return tuple(ep.load() for _, ep in sorted(registered(RECIPE_CHECKS).items()))


def check_recipe(recipe: Mapping[str, Any]) -> None:
    """Run every installed recipe check; ValidationFailed with the check's code."""
    for check in recipe_checks():
        try:
            check(dict(recipe))
        except Exception as exc:
            code = getattr(exc, "code", None)
            if not isinstance(code, str):
                raise  # a bug in the check, not a verdict on the recipe
            details = getattr(exc, "details", None)
            raise ValidationFailed(code, str(getattr(exc, "message", exc)),
                                   dict(details) if isinstance(details, Mapping) else {}
                                   ) from None
