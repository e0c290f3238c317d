"""The client installed alone: a new virtualenv, ``pip install ./maec_client``, no torch,
no merge library, no service code; ``maec jobs`` from that venv against the real stack.

Needs the package registry (or a warm pip cache) for httpx, pydantic and friends; the
install takes about 25 s, the jobs a few seconds.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stack import API_KEYS

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]


def run(*args: str | Path, env: dict[str, str], timeout: float = 240,
        ) -> subprocess.CompletedProcess[str]:
    # Run outside the work tree: ``python -c`` puts the current folder on sys.path.
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False, cwd=env["HOME"])


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("client-venv")
    # Built from a copy, so the build leaves no build/ or egg-info in the work tree.
    src = root / "src"
    ignore = shutil.ignore_patterns("__pycache__", "build", "*.egg-info")
    for name in ("maec_client", "maec_contract"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    # Nothing of the test run's own environment may leak into the venv's imports.
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")}
    env |= {"HOME": str(root), "XDG_CONFIG_HOME": str(root / "xdg"),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True)
    py = root / "venv" / "bin" / "python"
    # With build isolation: the venv's own setuptools is too old to build a wheel alone.
    res = run(py, "-m", "pip", "install", "-q", src / "maec_client", env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    return root / "venv", env


def test_installs_alone_and_runs_without_torch(venv):
    bin_dir, env = venv[0] / "bin", venv[1]
    res = run(bin_dir / "maec", "jobs", "--help", env=env)
    assert res.returncode == 0 and "submit" in res.stdout, res.stderr
    for module in ("torch", "maec_core", "app", "worker", "fastapi", "celery", "boto3"):
        res = run(bin_dir / "python", "-c", f"import {module}", env=env)
        assert res.returncode == 1 and "ModuleNotFoundError" in res.stderr, module
    res = run(bin_dir / "python", "-c", "import maec_client, maec_contract, sys; "
              "print(maec_client.__file__); "
              "print(sorted(m for m in sys.modules if m.startswith('maec')))", env=env)
    assert res.returncode == 0, res.stderr
    assert str(venv[0]) in res.stdout.splitlines()[0]  # the installed copy, not the tree


@pytest.fixture(scope="module")
def stack(make_module_stack, tiny_models):
    st = make_module_stack(local_roots=[tiny_models.root])
    st.wait_ready()
    return st


def test_submit_watch_download_from_the_bare_venv(venv, stack, tiny_models, tmp_path):
    bin_dir = venv[0] / "bin"
    env = venv[1] | {"MAEC_URL": stack.base_url, "MAEC_API_KEY": API_KEYS["alice"]}
    recipe = tmp_path / "linear.yaml"
    recipe.write_text(f"merge_method: linear\nmodels:\n"
                      f"  - model: {tiny_models.base}\n    parameters: {{weight: 0.4}}\n"
                      f"  - model: {tiny_models.donor}\n    parameters: {{weight: 0.6}}\n"
                      "dtype: float32\n")
    res = run(bin_dir / "maec", "jobs", "submit", recipe, "--name", "bare-venv", env=env)
    assert res.returncode == 0, res.stderr
    job_id = res.stdout.strip()
    res = run(bin_dir / "maec", "jobs", "watch", job_id, "--timeout", "120", "--json",
              env=env)
    assert res.returncode == 0, res.stderr
    job = json.loads(res.stdout)
    assert job["status"] == "succeeded" and job["name"] == "bare-venv"
    dest = tmp_path / "out"
    res = run(bin_dir / "maec", "jobs", "download", job_id, dest, "--json",
              "--part-size", "16KiB", env=env)
    assert res.returncode == 0, res.stderr
    files = json.loads(res.stdout)["files"]
    assert {f["path"] for f in files} == {f["path"] for f in job["result"]["files"]}
    for f in files:
        data = (dest / f["path"]).read_bytes()
        assert len(data) == f["size"] and hashlib.sha256(data).hexdigest() == f["sha256"]
    # Without the merge library, the service is the one that refuses a bad recipe.
    bad = tmp_path / "bad.yaml"
    bad.write_text("merge_method: ties\nmodels: [{model: s3://a}]\n")
    res = run(bin_dir / "maec", "jobs", "submit", bad, env=env)
    assert res.returncode == 2 and "[invalid_recipe]" in res.stderr
