"""``make bench-split``: a merge whose worker is killed part way, finished by another,
against the same merge uninterrupted, and the same merge split into parts on several
workers, on a local S3 store (SeaweedFS) with each worker's read rate capped
(``MAEC_S3_READ_BYTES_PER_S``), so one node's bandwidth is modelled on one machine.
Each worker has its own work folder, so its own input cache, as separate nodes would.

The family: a base and a fine-tune of it (``--size 3b``: about 2.7B parameters each,
bf16, 32 layers; ``--size small``: the reliability suite's 24-layer model, seconds),
uploaded to the store's input bucket with a whole-object SHA-256 (one part each, as
``aws s3 cp --checksum-algorithm SHA256`` gives below its multipart size: what lets a
worker name an input's digest without fetching all of it) and merged (TIES) from there
with small output shards. ``--method maec``: a second fine-tune as the language base,
merged by MAEC (``rank_scope: global``, ``selection: ratio``); its ability vector is
extracted by the first run and reused by the others (the store is shared), so the first
run (the whole one) is run twice and the second is timed; a MAEC merge's inputs are
fetched whole (its phases read every tensor). Each run is on a fresh stack (empty
caches):

- uninterrupted: submitted to one worker and waited for (wall: submission to success);
- resumed: submitted to two workers; once ``--kill-at`` of its planned shards are
  recorded as published, the worker running it is SIGKILLed whole (not only its pool
  child, whose parent would claim it again with a warm cache): the lease (3 s) runs
  out, the other worker, its cache empty, resumes from the published shards
  (worker/resume.py), fetching only what the shards left read (worker/partial.py).

Printed: ``RESULT split speedup_2=... speedup_4=... identical=1|0
resume_wall_vs_uninterrupted=... refetched_bytes_ratio=...``

- ``identical``: every file of the resumed job, and of each split run, has the
  uninterrupted job's sha256;
- ``resume_wall_vs_uninterrupted``: the resumed job's wall (submission to success, the
  lease wait included) over the uninterrupted one's;
- ``refetched_bytes_ratio``: the input bytes the resuming attempt fetched from the store
  (the surviving worker's log: headers and ranges), over the inputs' size; about the
  fraction of shards not yet published;
- ``speedup_2`` (``speedup_4`` with ``--four``, else ``n/a``): the same merge run whole
  on one worker, over its wall split into 2 (4) parts on 2 (4) workers
  (``MAEC_SPLIT_ABOVE_BYTES``, ``MAEC_SPLIT_PARTS``: worker/split.py). Each part fetches
  the inputs' headers and the byte ranges its shards read, so under the read cap the
  fetch is shared between the workers as the merge and the upload are.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES: dict[str, dict[str, Any]] = {
    "3b": {"hidden_size": 2560, "intermediate_size": 6912, "num_hidden_layers": 32,
           "num_attention_heads": 20, "num_key_value_heads": 4, "vocab_size": 32000},
    "small": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 24},
}
SHARD = {"3b": "500MB", "small": "5MB"}
FETCHED = re.compile(r"job (j_[0-9a-f]+): inputs ready \((\d+) bytes fetched")


def build(root: Path, size: str, method: str = "ties") -> list[Path]:
    names = ["base", *(("tuned2", "tuned3") if method == "maec" else ("tuned2",))]
    if size == "3b":
        # Streamed, one tensor at a time, in bf16 (bench.common.build_family): a
        # transformers model of this size and its parent would take ~22 GB of RAM. Its
        # files (1 GB shards) are under the one-part upload's limit (upload: 5 GiB), so
        # each keeps a whole-object SHA-256.
        from bench.common import LlamaShape, build_family

        c = SIZES[size]
        shape = LlamaShape(hidden=c["hidden_size"], layers=c["num_hidden_layers"],
                           intermediate=c["intermediate_size"], vocab=c["vocab_size"],
                           heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"])
        folders = [root / n for n in names]
        build_family(folders, shape)
        return folders
    from tests.factories import make_llama

    base = make_llama(root / "base", seed=1, tokenizer=False, **SIZES[size])
    return [base, *(make_llama(root / n, seed=int(n[-1]), like=base, tokenizer=False,
                               **SIZES[size]) for n in names[1:])]


def body(uris: list[str], shard: str, method: str = "ties") -> dict[str, Any]:
    if method == "maec":
        return {"recipe": {
            "merge_method": "maec", "base_model": uris[0], "language_base": uris[2],
            "abilities": [{"model": uris[1]}], "out_shard_size": shard,
            "parameters": {"rank_scope": "global", "selection": "ratio"},
            "name": "bench-split"}}
    return {"recipe": {
        "merge_method": "ties", "base_model": uris[0], "out_shard_size": shard,
        "models": [{"model": uris[1], "parameters": {"weight": 0.5, "density": 0.5}}],
        "name": "bench-split"}}


def _planned(rec: dict[str, Any]) -> int | None:
    for name in ((rec.get("shards") or {}).get("files") or {}):
        m = re.search(r"-of-(\d+)\.safetensors$", name)
        if m:
            return int(m.group(1))
    return None


def upload(s3: Any, folder: Path, prefix: str) -> str:
    """Upload a checkpoint folder with a whole-object SHA-256 per file (one part);
    returns its ``s3://`` source string."""
    from boto3.s3.transfer import TransferConfig

    from tests.stack import S3_INPUTS_BUCKET

    one_part = TransferConfig(multipart_threshold=5 * 2**30)
    c = s3.client()
    for p in sorted(folder.iterdir()):
        if p.is_file():
            c.upload_file(str(p), S3_INPUTS_BUCKET, f"{prefix}/{p.name}",
                          ExtraArgs={"ChecksumAlgorithm": "SHA256"}, Config=one_part)
    return f"s3://{S3_INPUTS_BUCKET}/{prefix}"


def run_once(work: Path, s3: Any, uris: list[str], shard: str, env: dict[str, str],
             kill_at: float | None, workers: int = 2, method: str = "ties"
             ) -> tuple[float, dict[str, Any], int]:
    """(wall seconds, the finished job, input bytes the job's last attempt fetched)."""
    import psutil

    from tests.reliability import helpers as h
    from tests.stack import stack_context, wait_for

    with stack_context(work, None, storage="s3", s3=s3, workers=0, env=env) as st:
        # Each worker its own work folder, so its own input cache (a node of its own).
        procs = [st.start_worker({"MAEC_WORK_DIR": str(work / f"node{i}")}, wait=False)
                 for i in range(workers)]
        for proc in procs:
            st.wait_worker(proc)
        t0 = time.monotonic()
        job = st.submit(body(uris, shard, method))
        if kill_at is not None:
            def far_enough() -> dict[str, Any] | None:
                rec = h.record(st, job["id"])
                n = _planned(rec)
                got = len((rec.get("shards") or {}).get("files") or {})
                return rec if n and got >= kill_at * n else None

            rec = wait_for(far_enough, 3600, "the kill point", interval=0.1)
            child = h.child_running(st, rec)
            dead = next(i for i, w in enumerate(st.workers)
                        if child in {c.pid for c in psutil.Process(w.pid).children(True)})
            st.kill_worker(dead)
            procs = [w for i, w in enumerate(st.workers) if i != dead]
        done = st.wait(job["id"], timeout=7200)
        wall = time.monotonic() - t0
        if done["status"] != "succeeded":
            raise SystemExit(f"job {done['status']}: {done.get('error')}")
        # The last attempt's fetch: from the log of a worker that was not killed.
        fetched = [int(m.group(2)) for m in FETCHED.finditer(h.log_text(procs))
                   if m.group(1) == job["id"]]
    # The run's caches and work folders (at 3b, up to the inputs' size) go before the
    # next run, so the bench needs room for one run at a time.
    shutil.rmtree(work, ignore_errors=True)
    return wall, done, fetched[-1] if fetched else 0


def _files(job: dict[str, Any]) -> dict[str, str]:
    return {f["path"]: f["sha256"] for f in job["result"]["files"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="3b")
    ap.add_argument("--read-mb-s", type=float, default=200.0,
                    help="each worker's S3 read cap, MB/s (MAEC_S3_READ_BYTES_PER_S)")
    ap.add_argument("--kill-at", type=float, default=0.6,
                    help="fraction of the planned shards published when the worker dies")
    ap.add_argument("--four", action="store_true",
                    help="also split into 4 parts on 4 workers (a machine with the cores)")
    ap.add_argument("--method", choices=("ties", "maec"), default="ties")
    args = ap.parse_args()
    method = args.method
    from tests.stack import S3Server

    env = {"MAEC_LEASE_SECONDS": "3", "MAEC_PROGRESS_INTERVAL": "0.2",
           "MAEC_S3_READ_BYTES_PER_S": str(int(args.read_mb_s * 1e6)),
           "MAEC_S3_DOWNLOAD_PART_BYTES": str(8 << 20)}
    split_same = True
    with tempfile.TemporaryDirectory(prefix="bench-split-") as tmp:
        root = Path(tmp)
        models = build(root / "models", args.size, method)
        inputs = sum(p.stat().st_size for m in models for p in m.iterdir() if p.is_file())
        # The inputs and every run's output stay in the store: at 3b about 33 GB.
        s3 = S3Server(root / "s3", volume_mb=1024 if args.size == "3b" else 64).start()
        try:
            uris = [upload(s3, m, f"split/{m.name}") for m in models]
            shutil.rmtree(root / "models")  # the store has them now
            if method == "maec":  # the ability vector extracted, for every run to reuse
                run_once(root / "extract", s3, uris, SHARD[args.size], env, None, workers=1,
                         method=method)
            whole_s, whole, _ = run_once(root / "whole", s3, uris, SHARD[args.size], env, None,
                                         workers=1, method=method)
            split_s: dict[int, float] = {}
            for n in (2, 4) if args.four else (2,):
                split_env = {**env, "MAEC_SPLIT_ABOVE_BYTES": "1", "MAEC_SPLIT_PARTS": str(n)}
                split_s[n], split, _ = run_once(root / f"split{n}", s3, uris, SHARD[args.size],
                                                split_env, None, workers=n, method=method)
                same_split = _files(split) == _files(whole)
                split_same = split_same and same_split if n != 2 else same_split
            resumed_s, resumed, refetched = run_once(root / "resumed", s3, uris,
                                                     SHARD[args.size], env, args.kill_at,
                                                     method=method)
        finally:
            s3.kill()
    same = _files(whole) == _files(resumed) and split_same
    speedup = {n: f"{whole_s / split_s[n]:.2f}" if n in split_s else "n/a" for n in (2, 4)}
    print(f"inputs {inputs / 1e9:.2f} GB; uninterrupted {whole_s:.1f} s; resumed "
          f"{resumed_s:.1f} s (attempts {resumed['attempts']}, "
          f"{(resumed['progress'].get('resumed') or {})} kept)")
    print("whole on 1 worker {:.1f} s; split: {}".format(whole_s, ", ".join(
        f"{n} workers {t:.1f} s" for n, t in split_s.items())))
    print(f"RESULT split speedup_2={speedup[2]} speedup_4={speedup[4]} identical={int(same)} "
          f"resume_wall_vs_uninterrupted={resumed_s / whole_s:.3f} "
          f"refetched_bytes_ratio={refetched / inputs:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
