"""`make run` (python -m app.run_local): everything starts, answers, and stops on Ctrl-C."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.stack import ROOT, free_port, wait_for

pytestmark = pytest.mark.integration


def test_run_local_starts_serves_and_stops(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.run_local", "--var", str(tmp_path), "--port", str(port)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
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
