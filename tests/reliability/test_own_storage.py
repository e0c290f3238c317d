"""The service's own storage is never a source, over HTTP against a real S3 store: bob,
who knows alice's job id, tries to read her published files as an input in every
spelling of the service's bucket and in every input role, and through ``job:<id>``;
alice reads her own output as ``job:<id>``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests import hostile
from tests.reliability.helpers import succeeded_linear_job
from tests.stack import S3_BUCKET, S3Server, Stack, stack_context

pytestmark = [pytest.mark.faults, pytest.mark.integration]

# Dozens of refused bodies in a row from one key.
ENV = {"MAEC_RATE_LIMIT_PER_MINUTE": "100000", "MAEC_RATE_LIMIT_BURST": "10000",
       "MAEC_SUBMISSIONS_PER_MINUTE": "100000"}
UNKNOWN = "j_000000000000deadbeef0000"


@pytest.fixture(scope="module")
def st(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server,
       model_root: Path) -> Iterator[Stack]:
    with stack_context(tmp_path_factory.mktemp("own-storage"), None, storage="s3",
                       s3=s3_server, workers=1, local_roots=[model_root], env=ENV) as stack:
        yield stack


@pytest.fixture(scope="module")
def alice_job(st: Stack, tiny: dict[str, Path]) -> dict[str, Any]:
    return succeeded_linear_job(st, tiny, "alice")


def _roles(tiny: dict[str, Path], model_root: Path, src: str) -> dict[str, dict[str, Any]]:
    qa = model_root / "own-storage-qa.jsonl"
    qa.write_text('{"question": "w1 w2", "answer": "3"}\n')
    return hostile.in_every_role(src, str(tiny["base"]), str(tiny["a"]), str(tiny["b"]),
                                 str(qa))


def test_the_service_bucket_is_never_a_source(st: Stack, s3_server: S3Server,
                                             alice_job: dict[str, Any],
                                             tiny: dict[str, Path], model_root: Path) -> None:
    jid = alice_job["id"]
    host = urlsplit(s3_server.endpoint).hostname or ""
    with st.client("bob") as bob:
        # The attack as reported: her prefix as his only model, at weight 1.0.
        r = bob.post("/v1/jobs", json={"recipe": {"merge_method": "linear", "models": [
            {"model": f"s3://{S3_BUCKET}/jobs/{jid}/a1", "parameters": {"weight": 1.0}}]}})
        assert (r.status_code, r.json()["code"]) == (422, "source_forbidden"), r.text
        # The files route answers him as for a job that does not exist.
        assert bob.get(f"/v1/jobs/{jid}/files/model.safetensors").status_code == 404
        for case in hostile.service_bucket_spellings(S3_BUCKET, jid, host):
            for role, body in _roles(tiny, model_root, case.source).items():
                r = bob.post("/v1/jobs", json=body)
                assert (r.status_code, r.json()["code"]) == (422, case.code), \
                    (case.name, role, r.text)
        assert bob.get("/v1/jobs", params={"limit": 100}).json()["jobs"] == []


def test_job_references_read_only_the_callers_own_jobs(st: Stack, alice_job: dict[str, Any],
                                                      tiny: dict[str, Path],
                                                      model_root: Path) -> None:
    jid = alice_job["id"]
    ref = f"job:{jid}"
    with st.client("bob") as bob:
        for src in (ref, f"job:{UNKNOWN}", f"job:{jid}/model.safetensors"):
            for role, body in _roles(tiny, model_root, src).items():
                r = bob.post("/v1/jobs", json=body)
                assert (r.status_code, r.json()["code"]) == (422, "source_not_found"), \
                    (src, role, r.text)
    body = {"recipe": {"merge_method": "linear",
                       "models": [{"model": ref, "parameters": {"weight": 1.0}}]}}
    done = st.wait(st.submit(body, key="alice")["id"], key="alice")
    assert done["status"] == "succeeded", done["error"]
    published = {f["path"]: f["sha256"] for f in alice_job["result"]["files"]}
    read = done["result"]["manifest"]["inputs"][ref]["files"]
    assert "model.safetensors" in read
    assert all(published[name] == sha for name, sha in read.items()), read
