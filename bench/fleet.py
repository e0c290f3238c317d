"""``make bench-fleet``: fair share and routing by size on one machine, against FIFO.

One stack per run (``tests.stack``): its own redis-server, the API under uvicorn, local
storage and three Celery worker processes in two pools: two in ``small``, one in
``large`` (which covers ``small``: it takes small jobs when it has none of its own).
The pools' disk sizes are set between the estimates of the three job kinds below,
computed here by the API's own estimator, so each kind has one right pool:

- short: a tiny task-arithmetic merge (fits ``small``);
- medium: a TIES merge of two 24-layer checkpoints (only ``large`` holds its disk);
- too big: four of those checkpoints (no pool holds it): must be refused at submission
  with ``no_capable_worker``, never queued.

Key A (alice) submits 30 jobs (28 short, 2 medium), then key B (bob) 3 short ones, then
A tries the too-big ones. The same workload runs twice, on fresh stacks: with the fair
scheduler (``MAEC_SCHEDULER_POLICY=fair``) and with plain FIFO (``fifo``: the oldest
queued job first, the same machinery otherwise).

Measured from the job records (and, for which worker process ran a job, its log):
- ``b_wait_p95_jobs``: the 95th percentile of B's waits (created -> started), in units
  of one short job's median duration on a worker: from its start to the next start on
  the same worker (its merge and publish, and the worker's turnaround to the next job,
  a fresh child process per job), fair runs;
- ``throughput_vs_fifo``: jobs per second (first submission -> last finish) of the fair
  run over the FIFO run's;
- ``routed_right``: jobs (both runs) whose routed pool and whose running worker's pool
  both hold the job's estimate;
- ``lost``: accepted jobs that did not succeed; ``duplicated``: jobs run more than once
  (attempts > 1) or published twice (manifests), both runs.

Ends with ``RESULT fleet workers=3 b_wait_p95_jobs=X throughput_vs_fifo=Y
routed_right=K/N refused_too_big=M lost=0 duplicated=0``. ``--runs N`` repeats each
policy N times (alternating which goes first; default 2) and reports medians.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.scheduler.estimate import Need  # noqa: E402
from app.scheduler.pools import fits  # noqa: E402
from app.settings import PoolSpec, Settings  # noqa: E402

GIB = 1 << 30
BIG: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 24}
A_SHORT, A_MEDIUM, B_SHORT, TOO_BIG = 28, 2, 3, 3
# The line the worker logs when the scheduler hands it a job (worker/dispatch.py).
TAKEN = re.compile(r"job (j_[0-9a-f]+): taken from the")


@dataclass
class Models:
    tiny: dict[str, Path]
    big: list[Path]


@dataclass
class Run:
    policy: str
    records: dict[str, dict[str, Any]] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)  # id -> short / medium
    owners: dict[str, str] = field(default_factory=dict)
    refused: int = 0
    manifests: dict[str, int] = field(default_factory=dict)
    ran_by: dict[str, int] = field(default_factory=dict)  # id -> worker process index


def build_models(root: Path) -> Models:
    from tests.factories import make_llama

    base = make_llama(root / "tiny-base", seed=0)
    tiny = {"base": base, "a": make_llama(root / "tiny-a", seed=1, like=base)}
    big = [make_llama(root / f"big-{i}", seed=10 + i, tokenizer=False, **BIG)
           for i in range(4)]
    return Models(tiny, big)


def short_job(m: Models, name: str) -> dict[str, Any]:
    return {"method": "linear", "ability_donor": [str(m.tiny["a"])],
            "language_base": str(m.tiny["base"]), "name": name}


def medium_job(m: Models, name: str, donors: int = 1) -> dict[str, Any]:
    return {"recipe": {
        "merge_method": "ties", "base_model": str(m.big[0]), "name": name,
        "models": [{"model": str(p), "parameters": {"weight": 0.5, "density": 0.5}}
                   for p in m.big[1:1 + donors]]}}


def estimates(m: Models, root: Path) -> dict[str, Need]:
    """The API's estimate of each job kind (the same code the submission runs)."""
    from app.api.job_body import to_request
    from app.storage.local import LocalStorage
    from app.submission import build_recipe, check_and_estimate
    from maec_contract import JobRequest

    settings = Settings(dev_mode=True, local_roots=[root], storage_dir=root / "est")
    storage = LocalStorage(settings.storage_dir)
    out = {}
    for kind, body in (("short", short_job(m, "e")), ("medium", medium_job(m, "e")),
                       ("too_big", medium_job(m, "e", donors=3))):
        recipe = build_recipe(to_request(JobRequest.model_validate(body)))
        out[kind] = check_and_estimate(recipe, settings, storage)[1]
    return out


def pools_between(est: dict[str, Need]) -> dict[str, PoolSpec]:
    short, medium, big = (est[k].disk_bytes for k in ("short", "medium", "too_big"))
    assert short < medium < big, est
    host = max(n.host_memory_bytes for n in est.values()) * 2 / GIB
    return {"small": PoolSpec(host_memory_gib=host, disk_gib=(short + medium) / 2 / GIB),
            "large": PoolSpec(host_memory_gib=host * 2, disk_gib=(medium + big) / 2 / GIB)}


def _t(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


def run_once(policy: str, m: Models, pools: dict[str, PoolSpec], work: Path,
             models_root: Path) -> Run:
    from tests.stack import stack_context

    env = {"MAEC_POOLS": json.dumps({n: p.model_dump() for n, p in pools.items()}),
           "MAEC_SCHEDULER_POLICY": policy, "MAEC_MAX_ACTIVE_JOBS_PER_KEY": "1000",
           "MAEC_SUBMISSIONS_PER_MINUTE": "100000", "MAEC_RATE_LIMIT_PER_MINUTE": "100000",
           "MAEC_RATE_LIMIT_BURST": "10000"}
    out = Run(policy)
    with stack_context(work / policy, None, workers=0, local_roots=[models_root],
                       env=env) as st:
        for pool in ("small", "small", "large"):
            st.start_worker({"MAEC_WORKER_POOL": pool}, wait=False)
        for w in st.workers:
            from tests.stack import wait_for

            wait_for(lambda w=w: st._worker_ready(w), 120, w.name, interval=0.1)
        with st.client("alice") as a, st.client("bob") as b:
            bodies = [short_job(m, f"a{i}") for i in range(A_SHORT)]
            # The medium jobs go in among A's, a third and two thirds of the way.
            for j, at in enumerate((A_SHORT // 3, 2 * A_SHORT // 3)):
                bodies.insert(at + j, medium_job(m, f"a-medium{j}"))
            for body in bodies:
                r = a.post("/v1/jobs", json=body)
                assert r.status_code == 202, r.text
                out.kinds[r.json()["id"]] = "medium" if "recipe" in body else "short"
                out.owners[r.json()["id"]] = "A"
            for i in range(B_SHORT):
                r = b.post("/v1/jobs", json=short_job(m, f"b{i}"))
                assert r.status_code == 202, r.text
                out.kinds[r.json()["id"]] = "short"
                out.owners[r.json()["id"]] = "B"
            for i in range(TOO_BIG):
                r = a.post("/v1/jobs", json=medium_job(m, f"a-huge{i}", donors=3))
                if r.status_code == 422 and r.json()["code"] == "no_capable_worker":
                    out.refused += 1
        ids = list(out.kinds)
        for job_id in ids:
            st.wait(job_id, key="alice" if out.owners[job_id] == "A" else "bob",
                    timeout=600)
        from tests.reliability.helpers import record

        for job_id in ids:
            out.records[job_id] = record(st, job_id)
            out.manifests[job_id] = len(list(
                (st.root / "storage" / "jobs" / job_id).glob("*/manifest.json")))
        for n, w in enumerate(st.workers):
            for job_id in TAKEN.findall(w.log_path.read_text(errors="replace")):
                out.ran_by[job_id] = n
        jobs_left = len(list((st.root / "storage").glob("jobs/*")))
        assert jobs_left == len(ids), "a refused job left files"
    return out


def percentile(xs: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def slot_seconds(run: Run) -> list[float]:
    """How long each short job held its worker: from its start to the next start on the
    same worker process (its merge, publish, and the worker's turnaround to the next
    job: a fresh child per job), for every job some other job followed."""
    by_worker: dict[int, list[str]] = {}
    for job_id, n in run.ran_by.items():
        by_worker.setdefault(n, []).append(job_id)
    out = []
    for ids in by_worker.values():
        ids.sort(key=lambda i: _t(run.records[i]["started_at"]))
        out += [_t(run.records[b]["started_at"]) - _t(run.records[a]["started_at"])
                for a, b in itertools.pairwise(ids) if run.kinds[a] == "short"]
    return out


def figures(run: Run) -> dict[str, float]:
    recs = run.records
    unit = statistics.median(slot_seconds(run))
    b_waits = [(_t(recs[i]["started_at"]) - _t(recs[i]["created_at"])) / unit
               for i in recs if run.owners[i] == "B"]
    first = min(_t(r["created_at"]) for r in recs.values())
    last = max(_t(r["finished_at"]) for r in recs.values())
    return {"b_wait_p95_jobs": percentile(b_waits, 0.95), "jobs_per_s": len(recs) / (last - first),
            "unit_s": unit}


def routed_right(run: Run, pools: dict[str, PoolSpec]) -> tuple[int, int]:
    ok = 0
    for rec in run.records.values():
        est = Need(**rec["estimate"])
        ran, routed = rec.get("ran_pool"), rec.get("pool")
        ok += int(ran in pools and routed in pools and fits(est, pools[ran])
                  and fits(est, pools[routed]))
    return ok, len(run.records)


def lost_and_duplicated(run: Run) -> tuple[int, int]:
    lost = sum(1 for r in run.records.values() if r.get("status") != "succeeded")
    dup = sum(1 for i, r in run.records.items()
              if int(r.get("attempts", 0)) > 1 or run.manifests.get(i, 0) > 1)
    return lost, dup


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        root = Path(tmp)
        models = build_models(root)
        est = estimates(models, root)
        pools = pools_between(est)
        for kind, need in est.items():
            print(f"estimate {kind}: host {need.host_memory_bytes / GIB:.2f} GiB, disk "
                  f"{need.disk_bytes / 2**20:.0f} MiB")
        print("pools: " + ", ".join(f"{n} disk {(p.disk_gib or 0) * 1024:.0f} MiB"
                                    for n, p in pools.items()))
        runs: list[Run] = []
        for i in range(args.runs):
            order = ("fair", "fifo") if i % 2 == 0 else ("fifo", "fair")
            for policy in order:
                t0 = time.monotonic()
                run = run_once(policy, models, pools, root / f"r{i}", root)
                f = figures(run)
                print(f"run {i} {policy}: b_wait_p95_jobs={f['b_wait_p95_jobs']:.2f} "
                      f"jobs_per_s={f['jobs_per_s']:.3f} median_job_slot_s={f['unit_s']:.2f} "
                      f"({time.monotonic() - t0:.0f} s)", flush=True)
                runs.append(run)
    fair = [figures(r) for r in runs if r.policy == "fair"]
    fifo = [figures(r) for r in runs if r.policy == "fifo"]
    b_wait = statistics.median(f["b_wait_p95_jobs"] for f in fair)
    ratio = statistics.median(fa["jobs_per_s"] / fi["jobs_per_s"]
                              for fa, fi in zip(fair, fifo, strict=True))
    print(f"fifo b_wait_p95_jobs={statistics.median(f['b_wait_p95_jobs'] for f in fifo):.2f}")
    for kind in ("short", "medium"):
        pairs = [(r.records[i]["measured"]["peak_rss_bytes"],
                  r.records[i]["estimate"]["host_memory_bytes"])
                 for r in runs for i in r.records if r.kinds[i] == kind]
        print(f"{kind} jobs: measured peak RSS {statistics.median(m for m, _ in pairs) / 2**20:.0f}"
              f" MiB, estimate {statistics.median(e for _, e in pairs) / 2**20:.0f} MiB, "
              f"max measured/estimate {max(m / e for m, e in pairs):.2f}")
    right = [routed_right(r, pools) for r in runs]
    ld = [lost_and_duplicated(r) for r in runs]
    refused = sum(r.refused for r in runs)
    print(f"RESULT fleet workers=3 b_wait_p95_jobs={b_wait:.2f} throughput_vs_fifo={ratio:.2f} "
          f"routed_right={sum(k for k, _ in right)}/{sum(n for _, n in right)} "
          f"refused_too_big={refused} lost={sum(x for x, _ in ld)} "
          f"duplicated={sum(y for _, y in ld)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
