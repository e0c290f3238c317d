"""``make run``: Redis + one Celery worker + the API on 127.0.0.1, in dev mode.

Everything lives under ``var/`` (Redis AOF in var/redis, results in var/storage, worker
cache in var/work); checkpoints under ``var/models`` (and any ``MAEC_LOCAL_ROOTS``) can
be named as sources. Ctrl-C stops all three, by the pids this process started.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STATE = "run.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Child:
    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self._log: IO[bytes] = open(log, "ab")  # noqa: SIM115 - closed in stop()
        # Own session: Ctrl-C reaches us, and we stop each child (and its forks) in order.
        self.proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 20) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()


def _wait(what: str, check: object, child: Child, timeout: float, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not child.alive():
            raise SystemExit(f"{what} exited; see {log}:\n{log.read_text()[-2000:]}")
        try:
            if check():  # type: ignore[operator]
                return
        except Exception:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{what} did not start within {timeout:.0f}s; see {log}")


def _redis_up(port: int) -> bool:
    import redis

    c = redis.Redis(port=port, socket_timeout=1)
    try:
        info: dict[str, Any] = c.info("persistence")  # type: ignore[assignment]
        return bool(c.ping()) and info["loading"] == 0
    finally:
        c.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--var", type=Path, default=ROOT / "var", help="state directory")
    ap.add_argument("--port", type=int, default=int(os.environ.get("MAEC_API_PORT", 8000)))
    ap.add_argument("--redis-port", type=int,
                    default=int(os.environ.get("MAEC_REDIS_PORT", 0)) or None)
    args = ap.parse_args(argv)
    var: Path = args.var.resolve()
    for sub in ("redis", "storage", "work", "models", "logs"):
        (var / sub).mkdir(parents=True, exist_ok=True)
    if not _port_free(args.port):
        raise SystemExit(f"127.0.0.1:{args.port} is in use (another `make run`?); "
                         "set MAEC_API_PORT")
    redis_bin = os.environ.get("MAEC_REDIS_SERVER") or shutil.which("redis-server") \
        or "/usr/bin/redis-server"
    redis_port = args.redis_port or _free_port()
    roots = [str(var / "models")]
    if os.environ.get("MAEC_LOCAL_ROOTS"):
        roots += json.loads(os.environ["MAEC_LOCAL_ROOTS"])
    env = {
        # One local user: per-key request limits would only throttle the demo's polling
        # and the benchmark (explicit settings in the environment still win).
        "MAEC_RATE_LIMIT_PER_MINUTE": "1000000",
        "MAEC_RATE_LIMIT_BURST": "100000",
        "MAEC_SUBMISSIONS_PER_MINUTE": "100000",
        **os.environ,
        "MAEC_DEV_MODE": "true",
        "MAEC_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "MAEC_STORAGE_BACKEND": "local",
        "MAEC_STORAGE_DIR": str(var / "storage"),
        "MAEC_WORK_DIR": str(var / "work"),
        "MAEC_LOCAL_ROOTS": json.dumps(roots),
        "PYTHONUNBUFFERED": "1",
    }
    logs = var / "logs"
    children: list[Child] = []
    url = f"http://127.0.0.1:{args.port}"
    try:
        redis = Child("redis", [redis_bin, str(ROOT / "deploy" / "redis.conf"), "--port",
                                str(redis_port), "--bind", "127.0.0.1", "--dir",
                                str(var / "redis"), "--daemonize", "no"],
                      env, logs / "redis.log")
        children.append(redis)
        _wait("redis-server", lambda: _redis_up(redis_port), redis, 30, logs / "redis.log")
        worker = Child("worker", [str(BIN / "celery"), "-A", "worker.celery_app", "worker",
                                  "-Q", "merges", "-c", "1", "-n", "local@%h",
                                  "--loglevel", "INFO", "--without-gossip",
                                  "--without-mingle"], env, logs / "worker.log")
        children.append(worker)
        api = Child("api", [str(BIN / "uvicorn"), "app.api.main:create_app", "--factory",
                            "--host", "127.0.0.1", "--port", str(args.port),
                            "--no-access-log"], env, logs / "api.log")
        children.append(api)
        _wait("API", lambda: httpx.get(url + "/healthz", timeout=1).status_code == 200,
              api, 60, logs / "api.log")
        _wait("worker", lambda: httpx.get(url + "/readyz", timeout=2).status_code == 200,
              worker, 120, logs / "worker.log")
        (var / STATE).write_text(json.dumps({"url": url, "pid": os.getpid(),
                                             "models": str(var / "models")}))
        print(f"""
maec-service is running (DEV MODE: no API keys; 127.0.0.1 only)
  API       {url}   (OpenAPI: {url}/docs)
  Redis     127.0.0.1:{redis_port}  (AOF in {var / 'redis'})
  storage   {var / 'storage'}
  sources   local folders under {', '.join(roots)}
  logs      {logs}

Try:
  curl {url}/readyz
  curl -X POST {url}/v1/jobs -H 'content-type: application/json' -d '{{
    "method": "maec", "base": "{var}/models/base",
    "ability_donor": ["{var}/models/donor"], "language_base": "{var}/models/lang"}}'
  curl {url}/v1/jobs/<id>
  make demo     # builds tiny checkpoints, runs a MAEC job end to end

Ctrl-C stops everything.""", flush=True)
        while all(c.alive() for c in children):
            time.sleep(0.5)
        dead = [c.name for c in children if not c.alive()]
        print(f"{', '.join(dead)} exited; stopping (logs in {logs})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nstopping...", flush=True)
        return 0
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not orphan
        for child in reversed(children):
            child.stop()
        with contextlib.suppress(FileNotFoundError):
            (var / STATE).unlink()


if __name__ == "__main__":
    sys.exit(main())
