"""Dev tool: the sha256 of every file a merge, a MAEC job, an evaluated job, a sweep and
an MoE job publish, run in-process through the API and the job runner on tiny local
checkpoints. Two trees that print the same lines publish the same bytes.

    python scripts/published_digests.py [ROOT]

ROOT (default /tmp/maec-published-digests, emptied first) holds the models, Redis and
storage; it is fixed because the manifests name local inputs by their paths. A digest
marked ``*`` is of the file with its run-dependent parts fixed (see ``_VARYING``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if TYPE_CHECKING:
    from tests.conftest import TinyModels

TEXT = "w1 w7 w3 w9 w4 w12 w30 w2 w8 w11 w5 w19\n\nw20 w3 w17 w25 w2 w33 w9 w1\n"
A = ["w1 w2 w3", "w4 w5"]
B = ["w20 w21", "w22 w23 w24"]


def job_bodies(m: TinyModels, sets: list[dict[str, str]]) -> dict[str, dict[str, Any]]:
    """The body of each kind of job, by name: a merge, a MAEC job, an evaluated job (its
    inputs scored too), a sweep publishing every candidate, and an MoE build."""

    def named(method: str, **kw: object) -> dict[str, object]:
        return {"method": method, "base": str(m.base), "ability_donor": [str(m.donor)],
                "language_base": str(m.lang), **kw}

    return {
        "merge": {"recipe": {"merge_method": "linear", "models": [
            {"model": str(m.donor), "parameters": {"weight": 0.3}},
            {"model": str(m.lang), "parameters": {"weight": 0.7}}]}},
        "maec": named("maec"),
        "evaluated": named("linear", evaluate=sets, evaluate_inputs=True,
                           parameters={"weight": 1.0}),
        "sweep": named("task_arithmetic", evaluate=sets, sweep={
            "grid": {"weight": [0.0, 1.0]},
            "objective": {"set": "wiki-sw", "metric": "perplexity"},
            "publish": "all"}),
        "moe": {"kind": "moe", "recipe": {
            "base_model": str(m.base), "gate_mode": "hidden", "dtype": "bfloat16",
            "experts": [{"source_model": str(m.donor), "positive_prompts": A},
                        {"source_model": str(m.lang), "positive_prompts": B}]}},
    }


def main(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    os.environ["MAEC_CACHE_DIR"] = str(root / "checksums")
    import redis
    from fastapi.testclient import TestClient

    from app.api.main import create_app
    from app.jobs.worker_store import WorkerJobStore
    from app.storage.local import LocalStorage
    from tests.api.conftest import make_settings
    from tests.conftest import TinyModels
    from tests.factories import make_llama
    from tests.stack import API_KEYS, RedisServer
    from worker.runner import JobRunner

    mroot = root / "models"
    base = make_llama(mroot / "base", 0)
    m = TinyModels(root=mroot, base=base, donor=make_llama(mroot / "donor", 1, like=base),
                   donor2=make_llama(mroot / "donor2", 4, like=base),
                   lang=make_llama(mroot / "lang", 2, like=base),
                   lang2=make_llama(mroot / "lang2", 5, like=base),
                   control=make_llama(mroot / "control", 3, like=base))
    extra = root / "extra"
    extra.mkdir()
    (extra / "wiki.txt").write_text(TEXT)
    sets = [{"name": "wiki-sw", "language": "sw", "kind": "perplexity",
             "path": str(extra / "wiki.txt")}]
    server = RedisServer(root / "redis").start()
    try:
        settings = make_settings(root, server.db_url(1), m)
        r = redis.Redis.from_url(server.db_url(1))
        r.flushdb()
        auth = {"Authorization": f"Bearer {API_KEYS['alice']}"}

        jobs = job_bodies(m, sets)
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            runner = JobRunner(settings, WorkerJobStore(r),
                               LocalStorage(settings.storage_dir), worker="digests")
            # sha256 of a file as published -> of the file with its varying parts fixed.
            renamed: dict[str, str] = {}
            for name, body in jobs.items():
                resp = client.post("/v1/jobs", json=body, headers=auth)
                assert resp.status_code == 202, resp.text
                jid = resp.json()["id"]
                outcome = runner.run(jid)
                job = client.get(f"/v1/jobs/{jid}", headers=auth).json()
                assert outcome == "succeeded", job.get("error")
                files = sorted(job["result"]["files"], key=lambda f: f["path"])
                # Manifests last: they list the other files' digests (see _fixed).
                files.sort(key=lambda f: f["path"].endswith("manifest.json"))
                for f in files:
                    data = client.get(f["url"], headers=auth).content
                    fixed = _fixed(data, f["path"], renamed)
                    mark = "*" if fixed != data else " "
                    if fixed != data:
                        renamed[hashlib.sha256(data).hexdigest()] = (
                            hashlib.sha256(fixed).hexdigest())
                    print(f"{name:9} {hashlib.sha256(fixed).hexdigest()}{mark} {f['path']}")
                result = dict(job["result"])
                for k in ("core_seconds",):
                    result.pop(k, None)
                result["files"] = [{k: v for k, v in f.items() if k != "url"}
                                   for f in result["files"]]
                doc = json.dumps(_strip_times(result, renamed), sort_keys=True).encode()
                print(f"{name:9} {hashlib.sha256(doc).hexdigest()} <job result, "
                      "timings and urls left out>")
    finally:
        server.stop()


# What would differ from run to run if a published file held it: a job id, a sweep's
# temporary folder (none does: tests/api/test_published_paths.py), and an eval report's
# wall-clock seconds.
_VARYING = [(re.compile(rb"j_[0-9a-f]{24}"), b"j_ID"),
            (re.compile(rb"\.out\.sweep-[a-z0-9_]+"), b".out.sweep-TMP")]


def _fixed(data: bytes, path: str, renamed: dict[str, str]) -> bytes:
    """``data`` with the parts that vary between runs fixed: ``_VARYING``, and in JSON
    files wall-clock seconds and the entries of files already fixed (``renamed``: their
    sha256 replaced, their size left out)."""
    for pattern, repl in _VARYING:
        data = pattern.sub(repl, data)
    if path.endswith(".json") and not path.endswith("tokenizer.json"):
        doc = _strip_times(json.loads(data), renamed)
        again = json.dumps(doc, indent=2, sort_keys=True).encode() + b"\n"
        if json.loads(again) != json.loads(data):
            return again
    return data


def _strip_times(doc: Any, renamed: dict[str, str]) -> Any:
    """``doc`` without wall-clock figures, file entries of fixed files fixed."""
    if isinstance(doc, dict):
        out = {k: _strip_times(v, renamed) for k, v in doc.items()
               if not (k.endswith("seconds") or k.endswith("_s"))}
        if doc.get("sha256") in renamed:
            out.pop("size", None)
        if "total_size" in out:
            out.pop("total_size")
        return out
    if isinstance(doc, list):
        return [_strip_times(v, renamed) for v in doc]
    if isinstance(doc, str) and doc in renamed:
        return renamed[doc]
    return doc


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/maec-published-digests"))
