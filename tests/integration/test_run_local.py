"""`make run` (python -m app.run_local): everything starts, answers, and stops on Ctrl-C
or SIGTERM; MAEC_DEV_MODE=false runs it with keys."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from app.run_local import port_free
from tests.stack import ROOT, free_port, sigint_as_in_a_terminal, wait_for

# As on a shared machine: another `make run` holds the default port meanwhile.
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("default_api_port_taken")]


def test_run_local_starts_serves_and_stops(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.run_local", "--var", str(tmp_path), "--port", str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
        preexec_fn=sigint_as_in_a_terminal)
    children: list[psutil.Process] = []
    try:
        state = tmp_path / "run.json"
        wait_for(state.is_file, 120, "run.json")
        url = json.loads(state.read_text())["url"]
        assert url == f"http://127.0.0.1:{port}"
        ready = httpx.get(url + "/readyz")  # dev mode: no key needed
        assert ready.status_code == 200 and ready.json()["workers"] == 1
        children += psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "redis-server" in names and "celery" in names and "uvicorn" in names
        for c in children:  # everything listens on loopback only
            for conn in c.net_connections(kind="tcp"):
                if conn.status == psutil.CONN_LISTEN:
                    assert conn.laddr.ip == "127.0.0.1", (c.cmdline(), conn.laddr)
        assert (tmp_path / "redis" / "appendonlydir").is_dir(), "AOF is on"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        assert b"DEV MODE" in out and b"stopping" in out
        time.sleep(0.5)
        assert not [c for c in children if c.is_running() and c.status() != "zombie"]
        assert not state.exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for c in children:  # only on failure: what run_local should have stopped
            if c.is_running():
                c.kill()


def test_run_local_with_keys_stops_everything_on_sigterm(tmp_path: Path) -> None:
    """MAEC_DEV_MODE=false is honoured (keys required), and a SIGTERM to run_local stops
    Redis, the worker and the API and frees their ports; nothing is orphaned."""
    port, redis_port = free_port(), free_port()
    env = {**os.environ, "MAEC_DEV_MODE": "false", "MAEC_REDIS_PORT": str(redis_port),
           "MAEC_API_KEYS": json.dumps({"me": hashlib.sha256(b"local-key-1").hexdigest()})}
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.run_local", "--var", str(tmp_path), "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True)
    pids: dict[str, int] = {}
    stopped = False
    try:
        state = tmp_path / "run.json"
        wait_for(lambda: state.is_file() or proc.poll() is not None, 180, "run.json")
        assert state.is_file(), proc.communicate(timeout=10)[0].decode()[-3000:]
        doc = json.loads(state.read_text())
        pids = doc["children"]
        assert set(pids) == {"redis", "worker", "api"}
        url = doc["url"]
        assert httpx.get(url + "/v1/jobs").status_code == 401
        key = {"Authorization": "Bearer local-key-1"}
        assert httpx.get(url + "/v1/jobs", headers=key).status_code == 200
        ready = httpx.get(url + "/readyz", headers=key)
        assert ready.status_code == 200 and ready.json()["workers"] == 1
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
        assert proc.returncode == 0, out.decode()[-3000:]
        assert b"DEV MODE" not in out and b"Authorization: Bearer $MAEC_API_KEY" in out
        assert b"make demo" in out  # the example's checkpoints do not exist yet
        assert not state.exists()
        alive = [n for n, pid in pids.items()
                 if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        assert alive == []
        stopped = True
        assert port_free(port) and port_free(redis_port)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in [] if stopped else pids.values():  # what run_local should have stopped
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)


def test_run_local_refuses_bad_settings_without_starting_anything(tmp_path: Path) -> None:
    raw = "a-raw-key-not-its-digest"
    env = {**os.environ, "MAEC_DEV_MODE": "false", "MAEC_API_KEYS": json.dumps({"me": raw})}
    out = subprocess.run(
        [sys.executable, "-m", "app.run_local", "--var", str(tmp_path), "--port",
         str(free_port())], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "MAEC_API_KEYS" in out.stderr and raw not in out.stdout + out.stderr
    assert not (tmp_path / "run.json").exists()
    assert not (tmp_path / "logs" / "redis.log").exists()


def test_run_local_on_a_taken_port_says_so_and_starts_nothing(tmp_path: Path) -> None:
    """Another `make run` holds 8000 (the fixture): the second one stops before starting
    anything and says which port and how to choose another."""
    env = {k: v for k, v in os.environ.items() if k != "MAEC_API_PORT"}
    out = subprocess.run([sys.executable, "-m", "app.run_local", "--var", str(tmp_path)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "127.0.0.1:8000 is in use" in out.stderr and "MAEC_API_PORT" in out.stderr
    assert not (tmp_path / "run.json").exists()
    assert not (tmp_path / "logs" / "redis.log").exists()


def test_children_stop_when_run_local_is_killed_outright(tmp_path: Path) -> None:
    """SIGKILL cannot be handled: the children are told by the kernel (parent-death
    signal) and stop, so the next run finds its ports free."""
    port, redis_port = free_port(), free_port()
    env = {**os.environ, "MAEC_REDIS_PORT": str(redis_port)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.run_local", "--var", str(tmp_path), "--port", str(port)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True)
    pids: dict[str, int] = {}
    try:
        state = tmp_path / "run.json"
        wait_for(lambda: state.is_file() or proc.poll() is not None, 180, "run.json")
        pids = json.loads(state.read_text())["children"]
        proc.kill()
        proc.wait(10)

        def gone() -> bool:
            return not [pid for pid in pids.values() if psutil.pid_exists(pid)
                        and psutil.Process(pid).status() != "zombie"]

        wait_for(gone, 60, "the children to stop")
        pids = {}
        wait_for(lambda: port_free(port) and port_free(redis_port), 10, "free ports")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in pids.values():  # only on failure: what should have stopped
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
