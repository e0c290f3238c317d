"""``make run``: Redis + one Celery worker + the API on 127.0.0.1.

Dev mode (no API keys) unless the environment says ``MAEC_DEV_MODE=false``; then the
API needs the keys in ``MAEC_API_KEYS`` like any deployment, and the settings are checked
before anything starts. Everything lives under ``var/`` (Redis AOF in var/redis, results
in var/storage, worker cache in var/work); checkpoints under ``var/models`` (and any
``MAEC_LOCAL_ROOTS``) can be named as sources, and the demo family (a real 135M chat model
and two siblings of it, scripts/demo.py) is put in ``var/models/demo`` when missing (the
README's first job names it). Ports: ``--port`` /
``MAEC_API_PORT`` (8000) and ``--redis-port`` / ``MAEC_REDIS_PORT`` (a free one). The
documented rate limits stay in force, and the banner prints them.

Ctrl-C, SIGTERM or SIGHUP stops all three, each by the process group this process
started, and removes ``var/run.json`` (which records the URL and the children's pids);
on Linux the children also get SIGTERM if this process is killed outright.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
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

from app.settings import Settings, SettingsInvalid, get_settings

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STATE = "run.json"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    """Whether a server could bind ``port`` on 127.0.0.1 now."""
    with socket.socket() as s:
        # As servers bind (uvicorn, redis): connections of a stopped server that linger
        # in TIME_WAIT do not make the port taken.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Stopped(Exception):
    """A stop signal arrived (SIGTERM, SIGHUP); raised where the main thread is."""


def _raise_stopped(signum: int, _frame: object) -> None:
    raise Stopped(signal.Signals(signum).name)


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec (Linux): be sent SIGTERM when this process dies, even by
    SIGKILL, which no handler here can see; otherwise the children would live on and
    hold their ports."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class Child:
    def __init__(self, name: str, args: list[str], env: dict[str, str], log: Path) -> None:
        self.name = name
        self._log: IO[bytes] = open(log, "ab")  # noqa: SIM115 - closed in stop()
        # Own session: Ctrl-C reaches us, and we stop each child (and its forks) in order.
        self.proc = subprocess.Popen(
            args, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True,
            # This process has no other threads when it starts children.
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )

    def alive(self) -> bool:
        return self.proc.poll() is None

    def terminate(self) -> None:
        """Send the child's process group SIGTERM (it stops in its own time)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def stop(self, deadline: float) -> None:
        """Wait for a terminated child until ``deadline`` (monotonic), then kill it."""
        if self.alive():
            try:
                self.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self._log.close()


def stop_together(children: list[Child], grace: float = 20) -> None:
    """Stop ``children`` side by side within one ``grace`` (seconds), not one grace each:
    on a loaded machine the worker's drain and the API's shutdown can each take most of
    it, and Ctrl-C must stay bounded."""
    for child in children:
        child.terminate()
    deadline = time.monotonic() + grace
    for child in children:
        child.stop(deadline)


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


def _worker_up(redis_url: str, window_s: float) -> bool:
    """A worker heartbeating in the job store: what /readyz counts (which itself needs a
    key outside dev mode)."""
    from app.jobs.api_store import ApiJobStore

    async def live() -> int:
        store = ApiJobStore.from_url(redis_url)
        try:
            return await store.live_workers(window_s)
        finally:
            await store.close()

    return asyncio.run(live()) > 0


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--var", type=Path, default=ROOT / "var", help="state directory")
    ap.add_argument("--port", type=int, default=int(os.environ.get("MAEC_API_PORT", 8000)))
    ap.add_argument("--redis-port", type=int,
                    default=int(os.environ.get("MAEC_REDIS_PORT", 0)) or None)
    return ap.parse_args(argv)


def _service_env(var: Path, redis_port: int) -> tuple[dict[str, str], list[str]]:
    roots = [str(var / "models")]
    if os.environ.get("MAEC_LOCAL_ROOTS"):
        roots += json.loads(os.environ["MAEC_LOCAL_ROOTS"])
    # The documented limits stay as they are (docs/configuration.md): the banner prints
    # the ones in force, and the environment may change them as in any deployment.
    env = {
        "MAEC_DEV_MODE": "true",
        **os.environ,
        "MAEC_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
        "MAEC_STORAGE_BACKEND": "local",
        "MAEC_STORAGE_DIR": str(var / "storage"),
        "MAEC_WORK_DIR": str(var / "work"),
        "MAEC_LOCAL_ROOTS": json.dumps(roots),
        "PYTHONUNBUFFERED": "1",
    }
    return env, roots


def _check_settings(env: dict[str, str]) -> Settings:
    """The settings the children will read, checked here first so a bad configuration
    stops before anything starts (the message names variables, never values)."""
    os.environ.update(env)
    try:
        return get_settings()
    except SettingsInvalid as exc:
        raise SystemExit(f"run_local: {exc.message}") from None


def api_command(port: int) -> list[str]:
    """uvicorn serving the API on 127.0.0.1:``port``, as ``make run`` starts it.

    Proxy headers off: nothing stands in front of this server, so an ``X-Forwarded-For``
    reaching it was written by the client itself. uvicorn would otherwise believe it from
    127.0.0.1 (its default trust), and every local client could pick the address the
    failed-authentication limit counts against."""
    return [str(BIN / "uvicorn"), "app.api.main:create_app", "--factory", "--host",
            "127.0.0.1", "--port", str(port), "--no-proxy-headers", "--no-access-log"]


def _start(var: Path, port: int, redis_port: int, env: dict[str, str],
           children: list[Child], heartbeat_s: float) -> None:
    """Redis, then the worker and the API; returns once all three are ready."""
    logs, url = var / "logs", f"http://127.0.0.1:{port}"
    redis_bin = os.environ.get("MAEC_REDIS_SERVER") or shutil.which("redis-server") \
        or "/usr/bin/redis-server"
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
    api = Child("api", api_command(port), env, logs / "api.log")
    children.append(api)
    _wait("API", lambda: httpx.get(url + "/healthz", timeout=1).status_code == 200,
          api, 60, logs / "api.log")
    _wait("worker", lambda: _worker_up(env["MAEC_REDIS_URL"], 3 * heartbeat_s), worker, 120,
          logs / "worker.log")


DEMO = ("base", "donor", "lang")


def _build_demo_models(var: Path) -> subprocess.Popen[bytes]:
    """The demo family for the first job, put in place by a child (torch stays out of
    this process) while the services start. The child decides whether the folder is up
    to date (it knows which family it holds) and returns at once when it is."""
    log = open(var / "logs" / "demo-models.log", "ab")  # noqa: SIM115 - the child's
    return subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "demo.py"), "--build-models",
         str(var / "models")], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None)


def _demo_models_built(builder: subprocess.Popen[bytes] | None, var: Path) -> None:
    if builder is None:
        return
    log = var / "logs" / "demo-models.log"
    try:
        code = builder.wait(600)
    except subprocess.TimeoutExpired:
        raise SystemExit(f"building the demo checkpoints took over 10 minutes; see {log}") \
            from None
    if code != 0:
        raise SystemExit(f"building the demo checkpoints failed; see {log}:\n"
                         f"{log.read_text()[-2000:]}")


def _limits(settings: Settings) -> str:
    """The rate limits in force, as the banner states them."""
    requests = ("off in dev mode (no key to count them against)" if settings.dev_mode else
                f"{settings.rate_limit_per_minute}/min per key "
                f"(burst {settings.rate_limit_burst})")
    return (f"requests {requests}; submissions {settings.submissions_per_minute}/min "
            f"per key; failed logins {settings.auth_failures_per_minute}/min per address "
            f"(burst {settings.auth_failure_burst})")


def _banner(url: str, var: Path, redis_port: int, roots: list[str],
            settings: Settings) -> str:
    demo, dev = var / "models" / "demo", settings.dev_mode
    auth = "" if dev else " -H \"Authorization: Bearer $MAEC_API_KEY\""
    make_demo = ("" if var == (ROOT / "var").resolve() else f"MAEC_VAR={var} ") + \
        ("make demo" if dev else "MAEC_API_KEY=<your key> make demo")
    mode = ("DEV MODE: no API keys" if dev else
            "API keys required (MAEC_API_KEYS); export MAEC_API_KEY=<your key> for the "
            "examples")
    return f"""
maec-service is running ({mode}; 127.0.0.1 only)
  API       {url}   (OpenAPI: {url}/docs)
  Redis     127.0.0.1:{redis_port}  (AOF in {var / 'redis'})
  storage   {var / 'storage'}
  sources   local folders under {', '.join(roots)}
  demo      a real 135M chat model and two siblings in {demo}/{{{','.join(DEMO)}}}
  limits    {_limits(settings)}
  logs      {var / 'logs'}

Try (docs/api.md, "A first job with curl", does this step by step):
  curl{auth} {url}/readyz
  curl{auth} -X POST {url}/v1/jobs -H 'content-type: application/json' -d '{{
    "method": "maec", "base": "{demo}/base", "ability_donor": ["{demo}/donor"],
    "language_base": "{demo}/lang", "parameters": {{"key_ratio": 0.1, "selection_ratio": 0.75}}}}'
  curl{auth} {url}/v1/jobs/<id>
  curl{auth} {url}/v1/jobs/<id>/files
  {make_demo}   # the same job from Python: download, verify, load, ask a question

Ctrl-C stops everything."""


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    var: Path = args.var.resolve()
    for sub in ("redis", "storage", "work", "models", "logs"):
        (var / sub).mkdir(parents=True, exist_ok=True)
    if not port_free(args.port):
        raise SystemExit(f"127.0.0.1:{args.port} is in use (another `make run`?); "
                         "set MAEC_API_PORT")
    redis_port = args.redis_port or _free_port()
    env, roots = _service_env(var, redis_port)
    settings = _check_settings(env)
    url = f"http://127.0.0.1:{args.port}"
    children: list[Child] = []
    # SIGTERM/SIGHUP end the run like Ctrl-C does, through the finally below; their
    # default would kill this process alone and orphan the children.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_stopped)
    builder: subprocess.Popen[bytes] | None = None
    try:
        builder = _build_demo_models(var)
        _start(var, args.port, redis_port, env, children, settings.worker_heartbeat_seconds)
        _demo_models_built(builder, var)
        # Written aside and renamed into place: a reader that sees the file sees all of it.
        pending = var / f".{STATE}.tmp"
        pending.write_text(json.dumps({
            "url": url, "pid": os.getpid(), "models": str(var / "models"),
            "children": {c.name: c.proc.pid for c in children}}))
        os.replace(pending, var / STATE)
        print(_banner(url, var, redis_port, roots, settings), flush=True)
        while all(c.alive() for c in children):
            time.sleep(0.5)
        dead = [c.name for c in children if not c.alive()]
        print(f"{', '.join(dead)} exited; stopping (logs in {var / 'logs'})", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, Stopped):
        print("\nstopping...", flush=True)
        return 0
    finally:
        # A second signal must not interrupt the stopping and orphan what is left.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        if builder is not None and builder.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(builder.pid, signal.SIGKILL)
            builder.wait(10)
        # The worker and the API together, Redis last: a draining worker still records
        # its job's state there.
        stop_together([c for c in children if c.name != "redis"])
        stop_together([c for c in children if c.name == "redis"])
        with contextlib.suppress(FileNotFoundError):
            (var / STATE).unlink()


if __name__ == "__main__":
    sys.exit(main())
