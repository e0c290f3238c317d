"""The MoE job kind at submission (``kind: moe``, a mergekit-moe config): the config
parsed, every checkpoint allow-listed, resolved and planned from headers and configs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.scheduler.estimate import Need, estimate_moe
from app.settings import Settings
from app.sources import Published, inspect_source, parse_source, pin_source, referenced_job
from app.storage.base import Storage
from maec_contract import MoeJobRequest
from maec_core.service import (
    MOE_METHOD,
    MoeConfig,
    MoePlan,
    RecipeError,
    TokenizerError,
    parse_moe_config,
    plan_moe,
)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class MoeSubmission:
    config: MoeConfig

    @property
    def method(self) -> str:
        return self.config.merge_method

    @property
    def name(self) -> str | None:
        return self.config.name

    def record_recipe(self) -> dict[str, Any]:
        return self.config.model_dump(mode="json", exclude_none=True, by_alias=True)

    def warnings(self) -> list[str]:
        return self.config.warnings

    def references(self) -> set[str]:
        return {i for i in map(referenced_job, self.config.sources()) if i is not None}

    def check_sources(self, settings: Settings, storage: Storage,
                      outputs: Mapping[str, Published] | None = None
                      ) -> tuple[dict[str, dict[str, Any]], Need, list[str]]:
        sources, plan = check_moe_sources(self.config, settings, storage, outputs)
        return sources, estimate_moe(self.config, plan, sources), []


class MoeKind:
    def owns(self, method: str) -> bool:
        return method == MOE_METHOD

    def inputs(self, config: dict[str, Any]) -> tuple[list[str], list[str]]:
        """An MoE build's base, and its experts as the donors."""
        try:
            parsed = MoeConfig.model_validate(config)
        except ValueError:
            return [], []
        return [parsed.base_model], list(dict.fromkeys(e.source_model
                                                       for e in parsed.all_experts()))

    def submission(self, req: MoeJobRequest) -> MoeSubmission:
        config = parse_moe_config(dict(req.recipe))
        if req.name is not None and config.name is None:
            config = config.model_copy(update={"name": req.name})
        return MoeSubmission(config)


MOE = MoeKind()


def check_moe_sources(config: MoeConfig, settings: Settings, storage: Storage,
                      outputs: Mapping[str, Published] | None = None
                      ) -> tuple[dict[str, dict[str, Any]], MoePlan]:
    """Allow-list, resolve and plan every checkpoint of an MoE config from headers and
    configs (output architecture, layer counts, MLP shapes, dtypes), and that the base
    has the tokenizer its prompts need; returns the sources pinned, as for a merge, and
    the plan (every output tensor, which the estimate sizes)."""
    refs = config.sources()
    if len(refs) > settings.max_models_per_job:
        raise RecipeError(
            f"the job names {len(refs)} checkpoints; this service takes at most "
            f"{settings.max_models_per_job} (MAEC_MAX_MODELS_PER_JOB)",
            limit=settings.max_models_per_job)
    parsed = {uri: parse_source(uri, settings, outputs) for uri in refs}
    folders = {uri: inspect_source(parsed[uri], storage, uri == config.base_model)
               for uri in refs}
    plan = plan_moe(config, folders)
    base = folders[config.base_model]
    if config.gate_mode not in ("random", "uniform_random") and not (
            base.tokenizer_data or any((base.root / n).is_file() for n in _TOKENIZER_FILES)):
        raise TokenizerError(f"{config.base_model}: no tokenizer, which gate mode "
                             f"{config.gate_mode} needs to read the prompts",
                             source=config.base_model)
    return {uri: pin_source(parsed[uri], storage).to_dict() for uri in refs}, plan
