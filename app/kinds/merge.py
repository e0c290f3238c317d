"""The merge job kind at submission: a recipe (named form or recipe form), planned and
checked by ``app.submission``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.scheduler.estimate import Need
from app.settings import Settings
from app.sources import Published, referenced_job
from app.storage.base import Storage
from app.submission import build_recipe, check_and_estimate
from maec_contract import JobRequest
from maec_core.service import MaecError, Recipe, parse_recipe, plan_job, recipe_warnings


@dataclass(frozen=True)
class MergeSubmission:
    recipe: Recipe

    @property
    def method(self) -> str:
        return self.recipe.merge_method

    @property
    def name(self) -> str | None:
        return self.recipe.name

    def record_recipe(self) -> dict[str, Any]:
        return self.recipe.model_dump(mode="json", exclude_none=True, by_alias=True)

    def warnings(self) -> list[str]:
        return recipe_warnings(self.recipe)

    def references(self) -> set[str]:
        return {i for i in map(referenced_job, plan_job(self.recipe).inputs) if i is not None}

    def check_sources(self, settings: Settings, storage: Storage,
                      outputs: Mapping[str, Published] | None = None
                      ) -> tuple[dict[str, dict[str, Any]], Need, list[str]]:
        return check_and_estimate(self.recipe, settings, storage, outputs)


BASE_ROLES = frozenset({"base", "language_base"})
DONOR_ROLES = frozenset({"ability_donor", "model", "slice_source"})


class MergeKind:
    def owns(self, method: str) -> bool:
        return True  # every record another kind does not own

    def inputs(self, recipe: dict[str, Any]) -> tuple[list[str], list[str]]:
        """(bases, donors) the recipe names. A stored recipe this version cannot parse
        (written by an older one) shows none rather than breaking the list."""
        try:
            refs = parse_recipe(recipe).sources()
        except (MaecError, ValueError):
            return [], []
        bases = [r.ref for r in refs if r.role in BASE_ROLES]
        donors = [r.ref for r in refs if r.role in DONOR_ROLES]
        return list(dict.fromkeys(bases)), list(dict.fromkeys(donors))

    def submission(self, req: JobRequest) -> MergeSubmission:
        return MergeSubmission(build_recipe(req))


MERGE = MergeKind()
