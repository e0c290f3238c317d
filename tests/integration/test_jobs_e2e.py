"""Submit -> poll -> download -> load, over HTTP against real processes."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration.conftest import Sources
from tests.stack import METRICS_TOKEN, Stack

pytestmark = pytest.mark.integration


def _download_all(stack: Stack, job: dict[str, Any], dest: Path) -> Path:
    dest.mkdir(parents=True)
    with stack.client() as c:
        manifest = c.get(f"/v1/jobs/{job['id']}/files/manifest.json").json()
        assert manifest == job["result"]["manifest"]
        for f in manifest["files"]:
            with c.stream("GET", f"/v1/jobs/{job['id']}/files/{f['path']}") as r:
                assert r.status_code == 200
                h = hashlib.sha256()
                with open(dest / f["path"], "wb") as out:
                    for chunk in r.iter_bytes():
                        h.update(chunk)
                        out.write(chunk)
            assert h.hexdigest() == f["sha256"], f["path"]
            assert (dest / f["path"]).stat().st_size == f["size"]
    return dest


def _generate(folder: Path) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    ids = tok("w1 w2 w3", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 4
    return [int(x) for x in out[0]]


def _poll(stack: Stack, job_id: str, timeout: float = 120) -> tuple[dict[str, Any], list]:
    seen: list[tuple[str, str | None, float]] = []
    with stack.client() as c:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = c.get(f"/v1/jobs/{job_id}").json()
            seen.append((job["status"], job["stage"], job["progress"]["fraction"]))
            if job["status"] in ("succeeded", "failed", "cancelled"):
                return job, seen
            time.sleep(0.02)
    raise TimeoutError(job_id)


def test_ready_and_metrics(stack: Stack) -> None:
    assert stack.wait_ready()["workers"] >= 1
    with stack.client(METRICS_TOKEN) as op:
        assert "maec_workers_live" in op.get("/metrics").text
    with stack.client() as c:  # a tenant's key: the operator's data is not its to read
        assert c.get("/metrics").json()["code"] == "operator_only"
    with stack.client(None) as anon:
        assert anon.get("/readyz").status_code == 401
        assert anon.get("/healthz").status_code == 200


def test_maec_from_s3_end_to_end(stack: Stack, s3_sources: Sources, tmp_path: Path) -> None:
    body = {"method": "maec", "base": s3_sources.base, "ability_donor": [s3_sources.donor],
            "language_base": s3_sources.lang, "parameters": {"key_ratio": 0.25},
            "name": "e2e-maec"}
    with stack.client() as c:
        r = c.post("/v1/jobs", json=body)
    assert r.status_code == 202 and r.headers["location"] == f"/v1/jobs/{r.json()['id']}"
    job, seen = _poll(stack, r.json()["id"])
    assert job["status"] == "succeeded", job["error"]
    assert job["artifact_reused"] is False and job["attempts"] == 1
    fractions = [f for _s, _st, f in seen]
    assert fractions == sorted(fractions), "progress never goes backwards"
    assert job["result"]["report"]["artifact_keys"]
    assert job["result"]["core_seconds"] > 0
    out = _download_all(stack, job, tmp_path / "out")
    assert (out / "maec_report.json").is_file()
    # The manifest names each input by its s3:// reference with each file's sha256 (the
    # bytes uploaded from the local folder), never by the worker's copy.
    manifest = job["result"]["manifest"]
    assert str(stack.root / "work") not in json.dumps(manifest)
    names = {"base": s3_sources.base, "donor": s3_sources.donor, "lang": s3_sources.lang}
    assert set(manifest["inputs"]) == set(names.values())
    for name, ref in names.items():
        folder = getattr(s3_sources.local, name)
        assert manifest["inputs"][ref]["files"] == {
            f.name: hashlib.sha256(f.read_bytes()).hexdigest()
            for f in folder.iterdir() if f.is_file()}, ref
    assert manifest["recipe"]["language_base"] == s3_sources.lang
    _generate(out)
    # Presigned redirect: the bytes come straight from the object store.
    with stack.client() as c:
        r = c.get(f"/v1/jobs/{job['id']}/files/config.json", params={"redirect": "true"})
        assert r.status_code == 307
        direct = httpx.get(r.headers["location"])
        assert direct.status_code == 200 and direct.content == (out / "config.json").read_bytes()
        part = c.get(f"/v1/jobs/{job['id']}/files/model.safetensors",
                     headers={"Range": "bytes=8-99"})
        assert part.status_code == 206
        assert part.content == (out / "model.safetensors").read_bytes()[8:100]

    # Same donor, another language: the ability vector comes from object storage.
    body2 = {**body, "language_base": s3_sources.lang2, "name": "e2e-maec-2"}
    second = stack.wait(stack.submit(body2)["id"])
    assert second["status"] == "succeeded", second["error"]
    assert second["artifact_reused"] is True
    assert second["result"]["report"]["artifact_keys"] == job["result"]["report"][
        "artifact_keys"]
    assert "from cache" in stack.workers[0].tail(20000)


def test_baseline_from_local_paths(stack: Stack, s3_sources: Sources, tmp_path: Path) -> None:
    m = s3_sources.local
    job = stack.wait(stack.submit({
        "method": "ties", "base": str(m.base), "ability_donor": [str(m.donor)],
        "language_base": str(m.lang), "parameters": {"density": 0.5}})["id"])
    assert job["status"] == "succeeded", job["error"]
    assert job["artifact_reused"] is None
    _generate(_download_all(stack, job, tmp_path / "ties"))


def test_idempotency_and_isolation(stack: Stack, s3_sources: Sources) -> None:
    m = s3_sources.local
    body = {"method": "task_arithmetic", "base": str(m.base), "ability_donor": [str(m.donor)],
            "language_base": str(m.lang), "idempotency_key": "once"}
    with stack.client() as c:
        first = c.post("/v1/jobs", json=body)
        again = c.post("/v1/jobs", json=body)
    assert (first.status_code, again.status_code) == (202, 200)
    assert first.json()["id"] == again.json()["id"]
    job = stack.wait(first.json()["id"])
    assert job["status"] == "succeeded"
    with stack.client("bob") as c:
        assert c.get(f"/v1/jobs/{job['id']}").json()["code"] == "job_not_found"
        assert c.get(f"/v1/jobs/{job['id']}/files/manifest.json").status_code == 404
        ids = [j["id"] for j in c.get("/v1/jobs").json()["jobs"]]
        assert job["id"] not in ids
    with stack.client() as c:
        assert job["id"] in [j["id"] for j in c.get("/v1/jobs?limit=100").json()["jobs"]]


def test_cancel_running_job(stack: Stack, s3_sources: Sources, corpus: Path) -> None:
    m = s3_sources.local
    job = stack.submit({
        "method": "maec", "base": str(m.base), "ability_donor": [str(m.donor)],
        "language_base": str(m.lang), "ability_corpus": str(corpus),
        "parameters": {"importance": "gradient", "token_budget": 600000, "seq_len": 64,
                       "batch_size": 8}})
    stack.wait(job["id"], until={"running"})
    time.sleep(1.5)  # into the gradient pass (tens of seconds of batches)
    with stack.client() as c:
        r = c.post(f"/v1/jobs/{job['id']}/cancel")
    assert r.status_code == 202 and r.json()["cancel_requested"] is True
    t0 = time.monotonic()
    done = stack.wait(job["id"], timeout=30)
    assert done["status"] == "cancelled", done
    assert time.monotonic() - t0 < 5, "a running job stops within seconds"
    assert stack.s3 is not None
    listed = stack.s3.client().list_objects_v2(Bucket="maec-test", Prefix=f"jobs/{job['id']}/")
    assert listed.get("KeyCount", 0) == 0
    # The worker is free again afterwards.
    nxt = stack.submit({"method": "linear", "ability_donor": [str(m.donor)],
                        "language_base": str(m.lang)})
    assert stack.wait(nxt["id"])["status"] == "succeeded"


def test_s3_source_validation(stack: Stack, s3_sources: Sources, tmp_path: Path) -> None:
    from tests import hostile

    s3 = stack.s3
    assert s3 is not None
    bad = hostile.pickle_only(s3_sources.local.donor, tmp_path / "pickled")
    pickled = s3.upload_folder(bad, "models/pickled")
    vocab = s3.upload_folder(hostile.vocab_mismatch(s3_sources.local.donor, tmp_path / "v"),
                             "models/vocab")
    cases = {pickled: "pickle_refused", vocab: "incompatible_checkpoints",
             "s3://maec-test-inputs/models/missing": "source_not_found",
             "s3://no-such-bucket-x/models/a": "source_not_found"}
    with stack.client() as c:
        for src, code in cases.items():
            r = c.post("/v1/jobs", json={"method": "task_arithmetic", "base": s3_sources.base,
                                         "ability_donor": [src],
                                         "language_base": s3_sources.lang})
            assert r.status_code == 422 and r.json()["code"] == code, (src, r.text)
            assert "/tmp" not in r.json()["message"], "errors name the source, not temp files"
    assert not hostile.marker_path(bad).exists()
