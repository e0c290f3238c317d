"""The first jobs the documentation shows, run verbatim with bash against a service
started as `make run` starts it (python -m app.run_local, demo checkpoints included), on
free ports: the README's (``maec jobs``), then docs/api.md's (curl, step by step). Only
the base URL differs (``MAEC_URL``), and each block runs from a directory standing in for
the repository root, so its ``var/`` is the run's and its ``.venv`` the test's."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.stack import ROOT, free_port, sigint_as_in_a_terminal, wait_for

pytestmark = pytest.mark.integration


def bash_block(page: Path, heading: str) -> str:
    """The first bash block under ``heading`` of ``page``."""
    text = page.read_text()
    section = text[text.index(heading):]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block is not None, f"{page.name}: {heading!r} has no bash block"
    return block.group(1)


def readme_first_job() -> str:
    return bash_block(ROOT / "README.md", "## First job")


def curl_first_job() -> str:
    return bash_block(ROOT / "docs" / "api.md", "## A first job with curl")


def test_the_first_jobs_run_verbatim_after_make_run(tmp_path: Path) -> None:
    readme, curl = readme_first_job(), curl_first_job()
    assert len(readme.splitlines()) <= 6, "the README's first job is at most 6 lines"
    assert "$MAEC_URL" in curl and "8000" in curl
    port = free_port()
    # `make run` with no MAEC_* settings of the test run leaking into it.
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAEC_")}
    # The blocks call `.venv/bin/maec` from the repository root: the test's own venv.
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    log = tmp_path / "run_local.out"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "app.run_local", "--var", str(tmp_path / "var"),
             "--port", str(port)], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=sigint_as_in_a_terminal)
    try:
        state = tmp_path / "var" / "run.json"
        wait_for(lambda: state.is_file() or proc.poll() is not None, 600, "run.json")
        assert state.is_file(), log.read_text()[-3000:]
        url = json.loads(state.read_text())["url"]
        banner = log.read_text()
        assert "limits    requests off in dev mode" in banner, banner
        assert "submissions 120/min per key" in banner, banner
        stdout = _run_block(readme, tmp_path, {**env, "MAEC_URL": url})
        # watch printed the job's summary; download said what it verified.
        m = re.search(r"^id:\s+(j_\w+)$", stdout, re.M)
        assert m is not None and "sha256 verified" in stdout, stdout
        job_id = m.group(1)
        _check_files(url, job_id, tmp_path / "var" / "first-job")
        _check_hub_download(url, job_id, tmp_path, env)
        # Out of the way of the curl block, which downloads into the same folder.
        (tmp_path / "var" / "first-job").rename(tmp_path / "var" / "first-job-readme")
        stdout = _run_block(curl, tmp_path, {**env, "MAEC_URL": url})
        _check_outcome(url, tmp_path, stdout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)  # run_local stops its children
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _run_block(script: str, root: Path, env: dict[str, str]) -> str:
    run = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout


def _check_files(url: str, job_id: str, out: Path) -> list[dict[str, object]]:
    """The job succeeded as MAEC, and ``out`` holds exactly its files, each as listed."""
    job = httpx.get(f"{url}/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded" and job["method"] == "maec", job
    listing = httpx.get(f"{url}/v1/jobs/{job_id}/files").json()["files"]
    names = {f["path"] for f in listing}
    assert {"model.safetensors", "config.json", "maec_report.json", "manifest.json"} <= names
    assert {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()} >= names
    for f in listing:
        data = (out / f["path"]).read_bytes()
        assert len(data) == f["size"] and hashlib.sha256(data).hexdigest() == f["sha256"]
    return list(listing)


def _check_outcome(url: str, root: Path, stdout: str) -> None:
    m = re.search(r"^(j_\w+) succeeded$", stdout, re.M)
    assert m is not None, stdout
    out = root / "var" / "first-job"
    listing = _check_files(url, m.group(1), out)
    for f in listing:  # the block printed the listing: path, size, sha256
        assert f"{f['path']}\t{f['size']}\t{f['sha256']}" in stdout
        assert f"{f['path']}: OK" in stdout  # sha256sum -c
    sums = (out / "SHA256SUMS").read_text().splitlines()
    assert len(sums) == len(listing)


# A user's own process: huggingface_hub reads HF_ENDPOINT at import. from_pretrained
# first, on an empty cache, so it fetches the files itself; then the whole snapshot,
# whose files' sha256 the test compares with the listing.
_HUB_LOAD = """
import hashlib, pathlib, sys
from huggingface_hub import snapshot_download
from transformers import AutoModelForCausalLM, AutoTokenizer
repo = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(repo)
tok = AutoTokenizer.from_pretrained(repo)
print("loaded", type(model).__name__, "chat template", tok.chat_template is not None)
folder = pathlib.Path(snapshot_download(repo))
print("commit", folder.name)
for p in sorted(folder.rglob("*")):
    if p.is_file():
        print("file", p.relative_to(folder).as_posix(), hashlib.sha256(p.read_bytes()).hexdigest())
"""


def _check_hub_download(url: str, job_id: str, root: Path, env: dict[str, str]) -> None:
    """The merged model fetched by id, ``jobs/<id>``, with HF_ENDPOINT at the service."""
    listing = httpx.get(f"{url}/v1/jobs/{job_id}/files").json()["files"]
    hub_env = {k: v for k, v in env.items() if not k.startswith(("HF_", "HUGGING_FACE_"))
               and k != "TRANSFORMERS_OFFLINE"}
    hub_env.update(HF_ENDPOINT=url, HF_HOME=str(root / "hf"), HF_HUB_DISABLE_TELEMETRY="1",
                   HF_HUB_DISABLE_PROGRESS_BARS="1")
    out = subprocess.run(
        [sys.executable, "-c", _HUB_LOAD, f"jobs/{job_id}"],
        cwd=root, env=hub_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "loaded LlamaForCausalLM chat template True" in out.stdout, out.stdout
    manifest = next(f for f in listing if f["path"] == "manifest.json")
    assert f"commit {manifest['sha256'][:40]}" in out.stdout
    got = re.findall(r"^file (\S+) (\w+)$", out.stdout, re.M)
    assert dict(got) == {f["path"]: f["sha256"] for f in listing}
