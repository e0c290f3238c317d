"""Sweeps over the real stack: API, Redis, a Celery worker and SeaweedFS S3.

Checkpoints and eval sets are read from S3; the leaderboard and every published file are
read back over HTTP and checked against their sha256; a cancelled sweep leaves nothing
in the bucket or in the worker's folders.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import httpx
import pytest

from tests.integration.conftest import Sources
from tests.stack import S3_BUCKET, S3_INPUTS_BUCKET, Stack

pytestmark = pytest.mark.integration

TEXTS = ["w1 w7 w3 w9 w4 w12 w30 w2 w8 w11 w5 w19 w22 w6 w13 w27",
         "w20 w3 w17 w25 w2 w33 w9 w1 w16 w28 w4 w35 w12 w7 w38 w21"]


@pytest.fixture(scope="module")
def eval_sets(stack: Stack) -> list[dict[str, Any]]:
    assert stack.s3 is not None
    c = stack.s3.client()
    c.put_object(Bucket=S3_INPUTS_BUCKET, Key="evalsets/wiki-sw.jsonl",
                 Body="".join(json.dumps({"text": t}) + "\n" for t in TEXTS).encode())
    c.put_object(Bucket=S3_INPUTS_BUCKET, Key="evalsets/other-en.txt",
                 Body=b"w40 w41 w42 w43 w44 w45\n\nw50 w51 w52 w53 w54\n")
    return [{"name": "wiki-sw", "language": "sw", "kind": "perplexity",
             "path": f"s3://{S3_INPUTS_BUCKET}/evalsets/wiki-sw.jsonl"},
            {"name": "other-en", "language": "en", "kind": "perplexity",
             "path": f"s3://{S3_INPUTS_BUCKET}/evalsets/other-en.txt"}]


def _body(src: Sources, sets: list[dict[str, Any]], grid: dict[str, list[float]],
          **sweep: Any) -> dict[str, Any]:
    return {"method": "maec", "base": src.base, "ability_donor": [src.donor],
            "language_base": src.lang, "name": "swept", "evaluate": sets,
            "sweep": {"grid": grid, "objective": {"set": "wiki-sw",
                                                  "metric": "perplexity"}, **sweep}}


def _get(c: httpx.Client, url: str) -> bytes:
    """The file's bytes, waiting out the per-key rate limit (this test reads ~50 files)."""
    while True:
        r = c.get(url)
        if r.status_code != 429:
            assert r.status_code == 200, r.text
            return r.content
        time.sleep(float(r.headers.get("retry-after", "1")))


def _objects(stack: Stack, prefix: str) -> list[str]:
    assert stack.s3 is not None
    listed = stack.s3.client().list_objects_v2(Bucket=S3_BUCKET, Prefix=prefix)
    return [o["Key"] for o in listed.get("Contents", [])]


def test_sweep_publishes_leaderboard_winner_and_candidates(
        stack: Stack, s3_sources: Sources, eval_sets: list[dict[str, Any]]) -> None:
    # key_ratios no other test uses: the bucket (and so the artifact store) may be shared
    # with other modules, and this test counts extractions.
    body = _body(s3_sources, eval_sets, {"key_ratio": [0.3, 0.6], "mu": [0.5, 1.0]},
                 publish="all", constraint={"set": "other-en", "metric": "perplexity",
                                            "max_ratio_to": "language_base",
                                            "value": 100.0})
    job = stack.wait(stack.submit(body)["id"], timeout=240)
    assert job["status"] == "succeeded", job["error"]
    sweep, result = job["result"]["sweep"], job["result"]
    assert [r["id"] for r in sweep["rows"]] == ["c00", "c01", "c02", "c03"]
    # Two key_ratios: two extractions; the mu-only candidates combined from them.
    assert sweep["extractions"] == 2
    assert [r["extracted"] for r in sweep["rows"]] == [True, False, True, False]
    assert sweep["reference"]["other-en"] > 0 and all(r["feasible"] for r in sweep["rows"])
    best = min(sweep["rows"], key=lambda r: r["scores"]["wiki-sw"])
    assert sweep["winner"] == best["id"] and best["rank"] == 1
    files = {f["path"]: f for f in result["files"]}
    for cid in ("c00", "c01", "c02", "c03"):
        assert f"candidates/{cid}/manifest.json" in files
        assert f"candidates/{cid}/eval_report.json" in files
    with stack.client() as c:
        for path, f in files.items():
            data = _get(c, f["url"])
            assert hashlib.sha256(data).hexdigest() == f["sha256"], path
        board = json.loads(_get(c, files["leaderboard.json"]["url"]))
        manifest = json.loads(_get(c, files["manifest.json"]["url"]))
        report = json.loads(_get(c, files["eval_report.json"]["url"]))
    assert board["winner"] == sweep["winner"] and board["rows"] == sweep["rows"]
    assert manifest["sweep"]["winner"] == sweep["winner"]
    assert manifest["recipe"]["parameters"]["key_ratio"] == best["values"]["key_ratio"]
    assert [m["label"] for m in report["models"]] == ["language_base", "c00", "c01", "c02",
                                                      "c03"]
    assert result["evaluation"]["label"] == sweep["winner"]


def test_cancelled_sweep_leaves_nothing(stack: Stack, s3_sources: Sources,
                                        eval_sets: list[dict[str, Any]]) -> None:
    grid = {"selection_ratio": [0.25, 0.5, 0.75, 1.0], "mu": [0.25, 0.5, 0.75, 1.0]}
    body = _body(s3_sources, eval_sets, grid, publish="all")
    body["parameters"] = {"key_ratio": 0.35}
    jid = stack.submit(body)["id"]
    with stack.client() as c:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            job = json.loads(_get(c, f"/v1/jobs/{jid}"))
            if job["progress"].get("candidate", 0) >= 2 or job["status"] not in (
                    "queued", "running"):
                break
            time.sleep(0.1)
        assert job["status"] == "running", job
        asked = time.monotonic()
        assert c.post(f"/v1/jobs/{jid}/cancel").status_code == 202
    job = stack.wait(jid, timeout=60)
    assert job["status"] == "cancelled"
    assert time.monotonic() - asked < 30
    assert _objects(stack, f"jobs/{jid}/") == []
    assert not (stack.root / "work" / "jobs" / jid).exists() or not any(
        (stack.root / "work" / "jobs" / jid).rglob("*"))
