"""``make bench-sweep``'s job-level harness, without a stack: the bodies it submits are
what the API accepts, and its wall-time cross-check tells agreement from disagreement."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.submission import JobRequest, build_recipe
from bench.sweep import GRID, recipe_data
from bench.sweep_jobs import (
    JobRun,
    _check_agree,
    _phase,
    _seconds,
    candidate_bodies,
    groups,
    sweep_body,
)


@pytest.fixture
def data(tmp_path: Path) -> dict[str, Any]:
    inputs = {k: tmp_path / k for k in ("base", "lang", "donor", "sets")}
    return recipe_data(inputs, "delta")


def test_sweep_is_one_job_publishing_the_best(data: dict[str, Any]) -> None:
    recipe = build_recipe(JobRequest.model_validate(sweep_body(data)))
    assert recipe.sweep is not None and recipe.sweep.publish == "best"
    assert recipe.sweep.grid == GRID
    assert groups(data) == len(GRID["key_ratio"])


def test_each_candidate_is_a_plain_evaluated_job(data: dict[str, Any]) -> None:
    bodies = candidate_bodies(data)
    assert list(bodies) == ["c00", "c01", "c02", "c03", "c04", "c05"]
    seen = []
    for body in bodies.values():
        recipe = build_recipe(JobRequest.model_validate(body))
        assert recipe.sweep is None
        assert [e.name for e in recipe.evaluate or []] == ["text-sw", "qa-sw"]
        assert recipe.method_inputs is not None
        seen.append((recipe.parameters["key_ratio"],
                     recipe.method_inputs.model_dump()["abilities"][0]["mu"]))
    # Grid order, the last knob fastest.
    assert seen == [(k, m) for k in GRID["key_ratio"] for m in GRID["mu"]]


def _run(wall: float, post: float, created: str, finished: str) -> JobRun:
    job = {"id": "j_1", "created_at": created, "finished_at": finished}
    return JobRun(job, wall, post, _seconds(created, finished))


def test_wall_agrees_with_record_within_what_the_polls_allow() -> None:
    # Record 2.000 s; the client waited 2.05 s: 0.03 s of POST after created_at and the
    # end seen 0.02 s late, within a 0.04 s poll window.
    _check_agree(_run(2.05, 0.04, "2026-01-01T00:00:00.000Z", "2026-01-01T00:00:02.000Z"),
                 seen_within=0.04)


@pytest.mark.parametrize("wall", [1.5, 2.5])
def test_wall_disagreeing_with_record_is_refused(wall: float) -> None:
    # Shorter than the record's own span, or longer than POST + poll window allow.
    run = _run(wall, 0.04, "2026-01-01T00:00:00.000Z", "2026-01-01T00:00:02.000Z")
    with pytest.raises(RuntimeError, match="disagree"):
        _check_agree(run, seen_within=0.04)


def test_phases_follow_status_then_stage() -> None:
    assert _phase({"status": "queued", "stage": None}) == "queued"
    assert _phase({"status": "running", "stage": "evaluate"}) == "evaluate"
    assert _phase({"status": "publishing", "stage": "publish"}) == "publish"
    assert _phase({"status": "succeeded", "stage": None}) == "succeeded"
