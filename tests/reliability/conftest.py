"""Fixtures of the reliability suite and its one-line RESULT summary.

The RESULT line counts every test marked ``faults`` (this folder, the core hostile-input
tests and the trust_remote_code scan) and the counters in ``tests.reliability.results``.
It is printed after pytest's own summary, so ``make test-faults`` ends with it, and it
is also written with the figures to ``var/reliability/last-run.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.reliability import results
from tests.stack import ROOT

_outcome: dict[str, Any] = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    _outcome["total"] = sum(1 for item in session.items if item.get_closest_marker("faults"))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config
                            ) -> None:
    passed: set[str] = set()
    bad: set[str] = set()
    for category in ("passed", "failed", "error"):
        for rep in terminalreporter.stats.get(category, []):
            if "faults" not in getattr(rep, "keywords", {}):
                continue
            (passed if category == "passed" else bad).add(rep.nodeid)
    total = _outcome.get("total", 0)
    if not total:
        return
    c = results.COUNTERS
    line = (
        f"RESULT reliability faults_passed={len(passed - bad)}/{total} "
        f"fuzz_requests={c['fuzz_requests']} fuzz_5xx={c['fuzz_5xx']} "
        f"property_bodies={c['property_bodies']} property_5xx={c['property_5xx']} "
        f"hostile_inputs={c['hostile_inputs']} hostile_bodies={c['hostile_bodies']} "
        f"lost_jobs={c['lost_jobs']} "
        f"duplicate_runs={c['duplicate_runs']} "
        f"webhooks_signed={c['webhooks_verified']}/{c['webhooks_expected']} "
        f"toctou_refused={c['toctou_refused']}/{c['toctou_cases']} "
        f"adapters_refused={c['adapters_refused']} "
        f"corrupt_downloads={c['corrupt_downloads']}/{c['deletes_mid_download']} "
        f"hostile_tokenizers={c['hostile_tokenizers']} "
        f"hostile_eval_sets={c['hostile_eval_sets']} "
        f"secrets_echoed={c['secrets_echoed']}/{c['secret_cases']}"
    )
    _outcome["line"] = line
    out = ROOT / "var" / "reliability"
    out.mkdir(parents=True, exist_ok=True)
    (out / "last-run.json").write_text(json.dumps({
        "result": line, "counters": c, "figures": results.FIGURES,
        "failed": sorted(bad), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }, indent=2, default=str) + "\n")
    if results.FIGURES:
        terminalreporter.write_sep("-", "reliability figures")
        for k, v in sorted(results.FIGURES.items()):
            terminalreporter.write_line(f"{k}: {v}")


def pytest_unconfigure(config: pytest.Config) -> None:
    # After pytest's final "N passed" line, so the run ends with the RESULT line.
    line = _outcome.get("line")
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if line and reporter is not None:
        reporter.write_line(line)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The allow-listed local root every stack of this suite serves sources from."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny(model_root: Path) -> dict[str, Path]:
    """Tiny compatible Llamas (a base and two fine-tunes): merges take milliseconds."""
    from tests.factories import make_llama

    base = make_llama(model_root / "tiny-base", seed=0)
    return {"base": base, "a": make_llama(model_root / "tiny-a", seed=1, like=base),
            "b": make_llama(model_root / "tiny-b", seed=2, like=base)}


# Big enough that a ties merge takes seconds (a window to kill, stop or pause a worker
# mid-combine), small enough to build in about a second: 24 layers, ~95 MB in float32.
BIG: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 24}


@pytest.fixture(scope="session")
def big(model_root: Path) -> dict[str, Path]:
    from tests.factories import make_llama

    return {
        "a": make_llama(model_root / "big-a", seed=1, tokenizer=False, **BIG),
        "b": make_llama(model_root / "big-b", seed=2, tokenizer=False, **BIG),
    }
