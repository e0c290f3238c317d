"""Schemathesis against the live OpenAPI schema: every operation, positive and negative
data, with a valid key; zero 5xx, and every response conforms to the schema (status
code documented, content type, body schema).

Requests are counted here (not by Schemathesis' runner) so the RESULT line reports what
was actually sent. ``MAEC_FUZZ_EXAMPLES`` sets the examples per operation and mode.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from tests.reliability import results
from tests.stack import API_KEYS, Stack, stack_context

pytestmark = [pytest.mark.faults, pytest.mark.integration, pytest.mark.slow]

# Per operation and mode. Operations without parameters exhaust their (tiny) input space
# after a handful; the five with parameters or a body carry the 2,000-request floor.
EXAMPLES = int(os.environ.get("MAEC_FUZZ_EXAMPLES", "300"))
MIN_REQUESTS = 2000


@pytest.fixture(scope="module")
def fuzz_stack(tmp_path_factory: pytest.TempPathFactory, tiny: dict[str, Path],
               model_root: Path) -> Iterator[Stack]:
    # One worker, so some fuzzed jobs on the real sources run; rate limits high enough
    # not to turn the fuzz run into a 429 test.
    env = {"MAEC_RATE_LIMIT_PER_MINUTE": "1000000", "MAEC_RATE_LIMIT_BURST": "100000",
           "MAEC_MAX_ACTIVE_JOBS_PER_KEY": "100000", "MAEC_SUBMISSIONS_PER_MINUTE": "100000"}
    with stack_context(tmp_path_factory.mktemp("fuzz"), None, workers=1,
                       local_roots=[model_root], env=env) as st:
        yield st


def test_schemathesis_all_operations(fuzz_stack: Stack, tiny: dict[str, Path]) -> None:
    import hypothesis
    import hypothesis.errors
    import schemathesis
    from hypothesis import HealthCheck
    from schemathesis import GenerationMode
    from schemathesis.core.result import Ok
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    base = fuzz_stack.base_url
    # A finished job, so the file and cancel routes also see an existing id.
    job = fuzz_stack.submit({"method": "linear", "ability_donor": [str(tiny["a"])],
                             "language_base": str(tiny["base"])})
    fuzz_stack.wait(job["id"])

    auth = {"Authorization": f"Bearer {API_KEYS['alice']}"}
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json", headers=auth)
    checks = [status_code_conformance, content_type_conformance, response_schema_conformance]
    session = requests.Session()
    statuses: Counter[int] = Counter()
    server_errors: list[str] = []
    nonconforming: list[str] = []
    per_operation: Counter[str] = Counter()
    started = time.monotonic()

    def fuzz_one(strategy: Any, label: str) -> None:
        @hypothesis.settings(max_examples=EXAMPLES, deadline=None, database=None,
                             derandomize=True, phases=[hypothesis.Phase.generate],
                             suppress_health_check=list(HealthCheck))
        @hypothesis.given(case=strategy)
        def run(case: Any) -> None:
            if "job_id" in (case.path_parameters or {}) and per_operation[label] % 3 == 0 \
                    and case.method.upper() != "DELETE":  # the job must outlive the run
                case.path_parameters["job_id"] = job["id"]  # reach the existing-job paths
            resp = case.call(base_url=base, session=session, headers=auth, timeout=30)
            per_operation[label] += 1
            statuses[resp.status_code] += 1
            if resp.status_code >= 500:
                server_errors.append(f"{label} {resp.status_code}: {resp.text[:300]}")
                return
            try:
                case.validate_response(resp, checks=checks)
            except (Exception, BaseExceptionGroup) as exc:  # collect, keep fuzzing
                nonconforming.append(f"{label} {resp.status_code}: {str(exc)[:400]}")

        run()

    operations = [r.ok() for r in schema.get_all_operations() if isinstance(r, Ok)]
    assert len(operations) >= 8, [op.label for op in operations]
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            label = f"{op.label} [{mode}]"
            try:
                fuzz_one(op.as_strategy(generation_mode=mode, headers=auth), label)
            except hypothesis.errors.Unsatisfiable:
                # No negative data exists for an operation without parameters or body.
                assert mode == GenerationMode.NEGATIVE and not per_operation.get(label), label
    elapsed = time.monotonic() - started
    session.close()
    sent = sum(per_operation.values())
    results.add("fuzz_requests", sent)
    results.add("fuzz_5xx", len(server_errors))
    results.figure("fuzz_seconds", round(elapsed, 1))
    results.figure("fuzz_status_counts", dict(sorted(statuses.items())))
    assert server_errors == [], "\n".join(server_errors[:20])
    assert nonconforming == [], "\n".join(nonconforming[:20])
    assert sent >= MIN_REQUESTS, per_operation
    # The API still serves normally after the fuzzing.
    with fuzz_stack.client() as c:
        assert c.get("/healthz").status_code == 200
        assert c.get(f"/v1/jobs/{job['id']}").json()["status"] == "succeeded"
