"""``make demo``: a MAEC job end to end over REST, against the local service.

Uses the service `make run` started (var/run.json), or starts one for the demo's
duration. The demo family under var/models/demo is a real chat model
(SmolLM2-135M-Instruct, tests/real_model.py) as ``base``, and two siblings made from it
with synthetic low-rank deltas as the English ability donor (``donor``) and the target
language model (``lang``). Submits a MAEC job, shows its progress, downloads every file,
checks each sha256 against the manifest, loads the result with transformers, prints its
answer to a fixed question beside the base's, and ends with ``DEMO OK job=<id>``.

``demo.py --build-models DIR`` only builds the checkpoints (under ``DIR/demo``, where they
are missing or from another family): what ``make run`` calls, so the README's first job
has its sources.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def find_service(var: Path) -> tuple[str, Path, subprocess.Popen[bytes] | None]:
    state = var / "run.json"
    if state.is_file():
        doc = json.loads(state.read_text())
        try:
            if httpx.get(doc["url"] + "/healthz", timeout=2).status_code == 200:
                print(f"using the running service at {doc['url']}")
                return doc["url"], Path(doc["models"]), None
        except httpx.HTTPError:
            pass
    print("no running service found: starting one (python -m app.run_local)")
    port = os.environ.get("MAEC_API_PORT", "8000")
    proc = subprocess.Popen([sys.executable, "-m", "app.run_local", "--var", str(var),
                             "--port", port], cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit("the service failed to start")
        if state.is_file():
            return url, var / "models", proc
        time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the service did not become ready")


DEMO = ("base", "donor", "lang")
# Which family a demo folder holds, so one built from an older family is rebuilt.
STAMP = "FAMILY"


def _link_or_copy(src: str, dst: str) -> object:
    """Hard links where the cache and the demo share a file system (no second copy of
    ~800 MB); a copy elsewhere. The merge never writes into its sources."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def build_models(models: Path) -> dict[str, Path]:
    from tests import real_model

    demo = models / "demo"
    paths = {n: demo / n for n in DEMO}
    unavailable = real_model.available()
    family = "tiny random (the real model is unavailable)" if unavailable else \
        f"{real_model.PACKAGE} {real_model.VERSION} {real_model.RECIPE} {real_model.DTYPE}"
    stamp = demo / STAMP
    if stamp.is_file() and stamp.read_text().strip() == family and \
            all((p / "model.safetensors").is_file() for p in paths.values()):
        return paths
    # Written beside, then renamed: a run stopped halfway leaves no folder that looks
    # complete.
    staging = models / ".demo.partial"
    shutil.rmtree(staging, ignore_errors=True)
    if unavailable:
        from tests.factories import make_llama

        print(f"WARNING: {unavailable}; building tiny random checkpoints in {demo} "
              "instead (they merge, but generate noise)", flush=True)
        make_llama(staging / "base", 0)
        make_llama(staging / "donor", 1, like=staging / "base", noise=0.05)
        make_llama(staging / "lang", 2, like=staging / "base")
    else:
        print(f"building the demo family in {demo} from {real_model.GGUF} "
              "(converted once, cached in .cache/real-model)", flush=True)
        built = real_model.real_family()
        for n in DEMO:
            shutil.copytree(built[n], staging / n, copy_function=_link_or_copy)
    (staging / STAMP).write_text(family + "\n")
    shutil.rmtree(demo, ignore_errors=True)
    staging.rename(demo)
    return paths


def answers(base: Path, merged: Path) -> dict[str, dict[str, str]]:
    """The base's and the merged model's greedy answer to the demo question, and the
    token each ranks first after "The capital of France is" (teacher forced: the greedy
    answer's first token is a near tie in the base, this one is not)."""
    from tests import real_model

    out: dict[str, dict[str, str]] = {}
    for who, folder in (("base", base), ("merged", merged)):
        model, tok = real_model.load(folder)
        out[who] = {"answer": real_model.answer(model, tok),
                    "next": real_model.next_token(model, tok)}
    return out


def print_answers(found: dict[str, dict[str, str]]) -> None:
    from tests import real_model

    print(f"question: {real_model.QUESTION}")
    for who, got in found.items():
        print(f"  {who:<7} {got['answer']!r}")
    print(f"next token after {real_model.ANSWER_PREFIX!r}: "
          + ", ".join(f"{who} {got['next']!r}" for who, got in found.items()))


def show(job: dict[str, Any]) -> None:
    p = job["progress"]
    bar = "#" * int(30 * p["fraction"])
    sys.stdout.write(f"\r  {job['status']:<10} {job['stage'] or '':<8} [{bar:<30}] "
                     f"{100 * p['fraction']:5.1f}%  {p['done']}/{p['total']}   ")
    sys.stdout.flush()


def main() -> int:
    if sys.argv[1:2] == ["--build-models"] and len(sys.argv) == 3:
        build_models(Path(sys.argv[2]))
        return 0
    var = Path(os.environ.get("MAEC_VAR", ROOT / "var")).resolve()
    url, models, started = find_service(var)
    headers = {}
    if os.environ.get("MAEC_API_KEY"):
        headers["Authorization"] = f"Bearer {os.environ['MAEC_API_KEY']}"
    try:
        paths = build_models(models)
        with httpx.Client(base_url=url, headers=headers, timeout=60) as c:
            body = {"method": "maec", "base": str(paths["base"]),
                    "ability_donor": [str(paths["donor"])],
                    "language_base": str(paths["lang"]),
                    "parameters": {"key_ratio": 0.1, "selection_ratio": 0.75},
                    "name": "demo"}
            r = c.post("/v1/jobs", json=body)
            if r.status_code not in (200, 202):
                raise SystemExit(f"submission refused: {r.status_code} {r.text}")
            job = r.json()
            print(f"submitted {job['id']} ({r.headers['location']})")
            while job["status"] not in ("succeeded", "failed", "cancelled"):
                show(job)
                time.sleep(0.25)  # 4 polls a second: well inside the request limit
                job = c.get(f"/v1/jobs/{job['id']}").json()
            show(job)
            print()
            if job["status"] != "succeeded":
                raise SystemExit(f"job {job['status']}: {json.dumps(job['error'])}")
            rep = job["result"]["report"]
            print(f"artifact reused: {job['artifact_reused']}; core merge "
                  f"{job['result']['core_seconds']:.3f}s; artifact keys "
                  f"{[k[:12] for k in rep.get('artifact_keys', [])]}")
            out = var / "demo-output" / job["id"]
            out.mkdir(parents=True, exist_ok=True)
            for f in job["result"]["files"]:
                h = hashlib.sha256()
                with c.stream("GET", f["url"]) as resp, open(out / f["path"], "wb") as fh:
                    resp.raise_for_status()
                    for chunk in resp.iter_bytes():
                        h.update(chunk)
                        fh.write(chunk)
                ok = h.hexdigest() == f["sha256"]
                print(f"  {f['path']:<28} {f['size']:>9} bytes  sha256 "
                      f"{'ok' if ok else 'MISMATCH'}")
                if not ok:
                    raise SystemExit(f"checksum mismatch for {f['path']}")
        from tests import real_model

        if real_model.available() is None:
            print_answers(answers(paths["base"], out))
        else:  # the tiny fallback family has no chat template and answers noise
            print("the demo family is tiny and random here: no answer to show")
        print(f"DEMO OK job={job['id']}")
        return 0
    finally:
        if started is not None:
            started.send_signal(2)  # SIGINT: run_local stops its children
            started.wait(60)


if __name__ == "__main__":
    sys.exit(main())
