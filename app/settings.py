"""The service's one settings class (env prefix ``MAEC_``), shared by the API and the worker.

Insecure or missing production settings are refused at start-up unless ``dev_mode`` is
on, so a forgotten environment variable cannot silently open the service.

Settings hold secrets (S3 keys; an API key pasted where its sha256 belongs), so no error
about them may repeat a value: validation errors hide their input, and ``get_settings``
turns them into one ``SettingsInvalid`` that names each variable and what is wrong.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from app.webhooks.hosts import AllowList
from maec_core.service import MaecError

log = logging.getLogger("maec.settings")

# Credentials that ship in examples; accepting them outside dev mode would be a hole.
_DEFAULT_SECRETS = frozenset({"", "minioadmin", "admin", "secret", "changeme", "dev"})


# The owner every request acts as in dev mode. Reserved: no configured API key may use
# this id, or that key would see (and delete) every job created earlier in dev mode
# against the same Redis.
DEV_OWNER = "dev"

# What a key id may be: it names the caller in Redis keys, job records, logs and error
# messages, so it is kept to characters that mean nothing in any of them (no ``:``, no
# space, no quote). Refused at start-up, before any key is built from it.
KEY_ID_PATTERN = r"^[A-Za-z0-9._-]{1,64}$"
KEY_ID_RULE = "1-64 characters of A-Z a-z 0-9 . _ -"
_KEY_ID = re.compile(KEY_ID_PATTERN)


def check_key_ids(ids: Iterable[str], what: str) -> None:
    """``ValueError`` naming the first id outside the key-id alphabet (``what``: whose
    ids, for the message). An overlong id may be a pasted key: only its start is shown."""
    for key_id in ids:
        if not _KEY_ID.fullmatch(key_id):
            shown = repr(key_id) if len(key_id) <= 64 else \
                f"{key_id[:8]!r}... ({len(key_id)} characters)"
            raise ValueError(f"{what} {shown} is not a valid key id: key ids are "
                             f"{KEY_ID_RULE}")


def hash_key(raw: str) -> str:
    """The form API keys are stored in: hex sha256 of the presented key."""
    return hashlib.sha256(raw.encode()).hexdigest()


class SettingsInvalid(MaecError):
    """The environment does not make a usable (or a safe) configuration."""

    code = "invalid_settings"


def env_name(field: str) -> str:
    return f"MAEC_{field.upper()}"


Priority = Literal["low", "normal", "high"]
PRIORITIES: tuple[Priority, ...] = ("low", "normal", "high")
GIB = 1 << 30
_POOL_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,39}$")


class PoolSpec(BaseModel):
    """What every worker of one pool can hold: host memory, GPU memory (0: a CPU pool)
    and local disk, in GiB; null is "no limit" (the single-machine default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    host_memory_gib: float | None = Field(default=None, gt=0)
    gpu_memory_gib: float = Field(default=0.0, ge=0)
    disk_gib: float | None = Field(default=None, gt=0)

    def limits(self) -> tuple[float, float, float]:
        """(host, gpu, disk) bytes, infinity for no limit."""
        inf = float("inf")
        return (inf if self.host_memory_gib is None else self.host_memory_gib * GIB,
                self.gpu_memory_gib * GIB,
                inf if self.disk_gib is None else self.disk_gib * GIB)


class Settings(BaseSettings):
    """Each field is ``MAEC_<NAME>``; its docstring is its line in docs/configuration.md
    (generated from this class: ``make docs``)."""

    # hide_input_in_errors: pydantic would otherwise print every offending value (a raw
    # API key, the whole input with the S3 secret for a model-level check) in its errors.
    model_config = SettingsConfigDict(env_prefix="MAEC_", extra="ignore",
                                      hide_input_in_errors=True,
                                      use_attribute_docstrings=True)

    dev_mode: bool = False
    """No auth (logged loudly): every request acts as key id `dev`. For `make run` only."""
    api_keys: dict[str, str] = Field(default_factory=dict)
    """JSON `{"key id": "<hex sha256 of the key>"}`; keys are stored hashed and compared in
    constant time, and a raw key here is refused. A key id is 1-64 characters of `A-Z a-z
    0-9 . _ -` (no `:`, no space); any other id, here or in any setting keyed by key id,
    stops the service at start-up. `dev` is reserved for dev mode."""

    redis_url: str = "redis://127.0.0.1:6379/0"
    """Broker and job store (`deploy/redis.conf`: AOF, `noeviction`)."""

    storage_backend: Literal["local", "s3"] = "local"
    """Where results and ability artifacts are stored: a local directory or an
    S3-compatible store."""
    storage_dir: Path = Path("var/storage")
    """The local storage directory (`storage_backend=local`); never a source, even under
    an allowed local root."""
    s3_endpoint_url: str | None = None
    """The S3-compatible store's endpoint (unset: AWS's)."""
    s3_bucket: str = "maec"
    """The bucket results and artifacts go to; `s3://` sources name the other buckets of
    this store (this one is never a source: a key reads its own outputs as `job:<id>`)."""
    s3_region: str = "us-east-1"
    """The store's region."""
    s3_access_key: str = ""
    """S3 access key; empty or a well-known default is refused outside dev mode."""
    s3_secret_key: str = ""
    """S3 secret key; empty or a well-known default is refused outside dev mode."""
    s3_public_endpoint_url: str | None = None
    """Where clients reach the store, when that differs from where the service does
    (compose: `http://s3:8333` inside, a public name outside); used for presigned URLs."""
    s3_presign_seconds: int = Field(default=300, ge=10, le=3600)
    """Lifetime of a presigned download URL (`?redirect=true`)."""
    s3_multipart_bytes: int = Field(default=64 * 1024 * 1024, ge=5 * 1024 * 1024)
    """Files above this size go up as multipart uploads, each part with a checksum."""
    s3_stream_part_bytes: int = Field(default=16 * 1024 * 1024, ge=5 * 1024 * 1024)
    """The part size of an output shard uploaded while the merge still writes it: what is
    left to send once the shard is finished is its last part (and those in flight), so
    smaller parts shorten a job's tail after its merge."""
    s3_transfer_concurrency: int = Field(default=8, ge=1, le=32)
    """Inputs are fetched as boto3's managed transfer does: this many ranged GETs at once
    per file (the client keeps 32 connections)."""
    s3_download_part_bytes: int = Field(default=16 * 1024 * 1024, ge=1024 * 1024)
    """The size of each ranged GET of an input; smaller objects are one GET."""
    s3_read_bytes_per_s: int | None = Field(default=None, ge=1024 * 1024)
    """Caps how fast a worker reads an input object from S3, in bytes per second (its
    ranged GETs together; unset: no cap). A whole object's parallel GETs share one cap;
    single GETs (objects under two download parts, the byte ranges a part of a split
    merge reads) share another; a job fetches through one of them at a time. Models
    one node's network bandwidth on a machine whose local store is faster than a real
    one's network (a benchmark of how a merge scales with workers); in production the
    network is the cap."""

    local_roots: list[Path] = Field(default_factory=list)
    """JSON list of allow-listed local checkpoint roots (absolute paths); `make run` adds
    `var/models`."""
    hub_enabled: bool = False
    """Allow `hf://owner/name@<40-hex revision>` sources (safetensors, json and tokenizer
    files only)."""

    # Worker side.
    work_dir: Path = Path("var/work")
    """The worker's working directory: the input cache, staging, artifact copies; never
    a source, even under an allowed local root."""
    cache_max_bytes: int = Field(default=50 * 10**9, ge=0)
    """The input cache (`work_dir/cache`): fetched checkpoint and corpus files, least
    recently used evicted beyond this (50 GB)."""
    artifact_cache_max_bytes: int = Field(default=10 * 10**9, ge=0)
    """A worker's local copies of MAEC ability artifacts (`work_dir/artifacts`, 10 GB),
    read instead of downloading only while storage still holds the artifact; least
    recently used go first, never one a running job reads (the total may exceed this
    while jobs hold more). An artifact is a few percent of its donor's size."""
    device: str | None = None
    """The worker's device (`cuda`, `cpu`, ...); unset: CUDA when present, else CPU."""
    preload_modules: list[str] = Field(
        default_factory=lambda: ["transformers.models.llama.modeling_llama"]
    )
    """Imported once in the worker's prefork parent so every merge child starts with them
    loaded (a gradient-importance MAEC job otherwise spends seconds importing the model
    class). Importing never initialises CUDA."""
    max_attempts: int = Field(default=3, ge=1, le=20)
    """Attempts per job before it fails with `worker_lost`."""
    task_time_limit: int = Field(default=6 * 3600, ge=10)
    """Hard limit per attempt in seconds (`time_limit` code); the broker's visibility
    timeout is set above it."""
    lease_seconds: int = Field(default=60, ge=2)
    """A running job whose lease is older than this is re-queued by live workers."""
    split_above_bytes: int = Field(default=0, ge=0)
    """A plain merge (a tensor method's or MAEC's) whose inputs total more bytes than this
    runs as parts on several workers of the pool, each part a contiguous group of output
    shards (0: never split). Set alike on every worker of a pool."""
    split_parts: int = Field(default=2, ge=2, le=64)
    """How many parts a split merge is cut into (at most its output shard count): about
    the number of workers the pool gives one merge."""
    progress_interval: float = Field(default=0.5, ge=0.0)
    """Seconds between a running job's progress writes to its record."""
    cancel_poll_interval: float = Field(default=0.25, ge=0.0)
    """Seconds between a running job's checks for a cancel request."""

    # API side.
    max_active_jobs_per_key: int = Field(default=100, ge=1)
    """Queued and running jobs per key (429 `too_many_jobs` beyond)."""
    submissions_per_minute: int = Field(default=120, ge=1)
    """Job submissions per key per minute, as many saved up (429 `rate_limited` beyond)."""
    max_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    """Largest request body (413 `request_too_large`)."""
    rate_limit_per_minute: int = Field(default=600, ge=1)
    """Requests per key per minute, shared by every API process (a token bucket in Redis;
    429 `rate_limited` with `Retry-After`). Dev mode has no key to count: no limit."""
    rate_limit_burst: int = Field(default=60, ge=1)
    """Requests per key saved up beyond the sustained rate."""
    auth_failures_per_minute: int = Field(default=60, ge=1)
    """Failed authentications per client address per minute (shared by every API
    process); while its bucket is empty every request from that address is refused."""
    auth_failure_burst: int = Field(default=20, ge=1)
    """Failed authentications per client address saved up."""
    metrics_token_sha256: str | None = None
    """Hex sha256 of the bearer token that reads `GET /metrics` (the operator's scrape
    credential, e.g. `printf %s "$TOKEN" | sha256sum`); the raw token is refused, and so
    is the hash of an API key. API keys get 403 `operator_only` there; unset: every key
    does, and only dev mode serves `/metrics` (without a token)."""
    metrics_per_key: bool = False
    """Add the per-key gauges `maec_key_queued` and `maec_key_running` (labelled with key
    ids) to `/metrics`. Off: only totals and per-pool figures, no key id leaves the
    service through metrics."""
    docs_require_key: bool | None = None
    """Whether `/docs` and `/openapi.json` need an API key; unset: yes, unless in dev
    mode."""
    max_models_per_job: int = Field(default=20, ge=2)
    """Checkpoints one job may name (donors, bases, controls); more is 422
    `invalid_recipe`."""
    max_corpus_bytes: int = Field(default=100 * 10**6, ge=1)
    """Largest ability corpus accepted (100 MB; larger is 422 `invalid_corpus`). The
    gradient pass reads only its token budget of it anyway."""
    lm_eval_task_dirs: str = ""
    """Folders of lm-evaluation-harness task YAMLs (`:`-separated) that `kind: lm_eval`
    eval sets may name besides lm-eval's own tasks; a job's lm_eval `path` must lie in
    one. Only operator folders: a task YAML can import Python. Read by the worker (and by
    the API to check task names at submission)."""
    lm_eval_data_dir: str = ""
    """Where lm-eval tasks that read local files (`dataset_path: json`, `csv`, ...) find
    their relative `data_files`; unset: the task YAML's own folder."""
    lm_eval_hub: bool = False
    """Whether lm-eval tasks may fetch their datasets from the Hugging Face Hub; unset,
    the worker evaluates with `HF_DATASETS_OFFLINE=1` and `HF_HUB_OFFLINE=1`, reading Hub
    datasets only from the local datasets cache."""
    worker_heartbeat_seconds: float = Field(default=5.0, gt=0)
    """How often a worker writes its heartbeat; `/readyz` counts workers seen within three
    of these."""
    api_gc_threshold: int = Field(default=20_000, ge=0)
    """The API process's cyclic-GC young-generation threshold, set after start-up objects
    are frozen (0: Python's default, 700). Many requests parked on Redis at once keep the
    default firing thousands of times a second; see `app/api/gc_tuning.py`."""

    # Pools and fair share (docs/scheduling.md).
    pools: dict[str, PoolSpec] = Field(default_factory=lambda: {"merges": PoolSpec()})
    """Every pool a deployment runs, by name (its Celery queue), with what each of its
    workers holds; the API routes each job to the smallest pool that fits its estimate and
    refuses one none fits (422 `no_capable_worker`). E.g. `{"cpu": {"host_memory_gib": 32,
    "disk_gib": 200}, "gpu-80g": {"host_memory_gib": 256, "gpu_memory_gib": 80,
    "disk_gib": 2000}}`. The default is one pool without limits."""
    worker_pool: str | None = None
    """The pool this worker belongs to (a key of `MAEC_POOLS`; unset: the first pool). It
    also takes the jobs of every pool it covers (no larger on any of the three) when its
    own has none. The API ignores it."""
    scheduler_policy: Literal["fair", "fifo"] = "fair"
    """`fair`: a free worker takes the next job of the key with the least running work per
    weight (a sweep counts its candidates); `fifo`: the oldest queued job."""
    key_weights: dict[str, float] = Field(default_factory=dict)
    """JSON `{"key id": weight}` (default 1): a key of weight 2 gets twice the workers of a
    key of weight 1 while both have jobs waiting. Key ids as in `MAEC_API_KEYS`."""
    priority_cap_default: Priority = "normal"
    """The highest priority (`low`, `normal`, `high`) a key may submit at, unless
    `MAEC_PRIORITY_CAPS` names it (403 `priority_not_allowed` above it)."""
    priority_caps: dict[str, Priority] = Field(default_factory=dict)
    """JSON `{"key id": "low" | "normal" | "high"}`: per-key priority caps. Key ids as in
    `MAEC_API_KEYS`."""

    # Retention and quotas (docs/api.md, "Retention").
    job_ttl_days: float | None = Field(default=None, gt=0)
    """Finished, unpinned jobs and their outputs are removed this many days after they
    ended (fractions allowed: 0.5 is twelve hours); unset: kept until deleted."""
    storage_quota_bytes_per_key: int | None = Field(default=None, ge=1)
    """Bytes of published outputs one key's jobs may hold (413 `quota_exceeded`); unset:
    no limit."""
    artifact_grace_seconds: float = Field(default=7 * 86400, ge=0)
    """An ability artifact no job references is deleted from storage after this long
    unused (7 days); a job reusing it meanwhile restarts the period."""
    retention_sweep_seconds: float = Field(default=60.0, gt=0)
    """How often one worker (whichever takes the period's lock) runs the retention
    sweep."""

    # Signed job webhooks (app/webhooks/, docs/api.md "Webhooks").
    webhook_allowed_hosts: list[str] = Field(default_factory=list)
    """JSON list of callback hosts: host names, `*.domain`, IP addresses, CIDR networks.
    Private, loopback and link-local addresses are refused unless an IP entry covers
    them. Empty: every `callback_url` is refused."""
    webhook_secrets: dict[str, SecretStr] = Field(default_factory=dict)
    """JSON `{"key id": "<secret, 16+ characters>"}`: the secret each key's webhooks are
    signed with; never shown back. Key ids as in `MAEC_API_KEYS`."""
    webhook_max_attempts: int = Field(default=8, ge=1, le=30)
    """Delivery attempts per webhook."""
    # A waiting attempt is a broker message held unacknowledged, so backoff_max stays
    # under the visibility timeout (task_time_limit + 600 s).
    webhook_backoff_seconds: float = Field(default=10.0, ge=0.05, le=3600)
    """Attempt n+1 runs min(backoff * 2**(n-1), backoff_max) seconds after attempt n
    failed: the first wait."""
    webhook_backoff_max_seconds: float = Field(default=3600.0, ge=0.05, le=86400)
    """The longest wait between attempts (keep it under the task time limit + 600 s)."""
    webhook_timeout_seconds: float = Field(default=10.0, gt=0, le=30)
    """Per connect, send and read; the delivery task's time limit
    (`app/webhooks/delivery.py`) assumes at most 30."""

    @field_validator("webhook_allowed_hosts")
    @classmethod
    def _webhook_hosts(cls, v: list[str]) -> list[str]:
        AllowList.parse(v)  # the allow-list's rules live with the address checks
        return v

    @field_validator("api_keys", "key_weights", "priority_caps", "webhook_secrets")
    @classmethod
    def _key_ids(cls, v: dict[str, object]) -> dict[str, object]:
        # Before the field's own checks' messages name an id, and before any Redis key,
        # metric or log line is built from one.
        check_key_ids(v, "key id")
        return v

    @field_validator("webhook_secrets")
    @classmethod
    def _webhook_secrets(cls, v: dict[str, SecretStr]) -> dict[str, SecretStr]:
        for key_id, secret in v.items():
            # Names the key id only: a secret is never repeated in an error.
            if len(secret.get_secret_value()) < 16:
                raise ValueError(f"the webhook secret of key id {key_id!r} is shorter than "
                                 "16 characters")
        return v

    @field_validator("api_keys")
    @classmethod
    def _hashes(cls, v: dict[str, str]) -> dict[str, str]:
        for key_id, digest in v.items():
            if key_id.strip().casefold() == DEV_OWNER:
                raise ValueError(f"key id {key_id!r} is reserved for dev mode's owner; "
                                 "name the key something else")
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest.lower()):
                raise ValueError(f"the entry for key id {key_id!r} must be a hex sha256 of "
                                 "the key (64 hex digits), never the key itself")
        return {k: d.lower() for k, d in v.items()}

    @model_validator(mode="after")
    def _metrics_token(self) -> Settings:
        token = self.metrics_token_sha256
        if not token:  # compose passes an unset variable as ""
            self.metrics_token_sha256 = None
            return self
        if len(token) != 64 or any(c not in "0123456789abcdef" for c in token.lower()):
            raise ValueError("MAEC_METRICS_TOKEN_SHA256 must be a hex sha256 of the token "
                             "(64 hex digits), never the token itself")
        self.metrics_token_sha256 = token.lower()
        if self.metrics_token_sha256 in self.api_keys.values():
            # A tenant holding that key would read every tenant's counts.
            raise ValueError("MAEC_METRICS_TOKEN_SHA256 is the hash of an API key; the "
                             "metrics token must be a credential of its own")
        return self

    @field_validator("pools")
    @classmethod
    def _pool_names(cls, v: dict[str, PoolSpec]) -> dict[str, PoolSpec]:
        if not v:
            raise ValueError("at least one pool is needed")
        for name in v:
            if not _POOL_NAME.match(name) or name == "webhooks":
                raise ValueError(f"pool name {name!r} must be 1-40 of a-z 0-9 _ - (not "
                                 "'webhooks': that queue is the webhooks')")
        return v

    @field_validator("key_weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        for key_id, w in v.items():
            if not 0 < w <= 1000:
                raise ValueError(f"the weight of key id {key_id!r} must be in (0, 1000]")
        return v

    @model_validator(mode="after")
    def _known_pool(self) -> Settings:
        if self.worker_pool is not None and self.worker_pool not in self.pools:
            raise ValueError(f"MAEC_WORKER_POOL {self.worker_pool!r} is not one of "
                             f"MAEC_POOLS ({', '.join(sorted(self.pools))})")
        return self

    @field_validator("local_roots")
    @classmethod
    def _absolute(cls, v: list[Path]) -> list[Path]:
        for root in v:
            if not root.is_absolute():
                raise ValueError(f"entry {str(root)!r} must be an absolute path")
        return [r.resolve() for r in v]

    @model_validator(mode="after")
    def _refuse_insecure(self) -> Settings:
        if self.dev_mode:
            return self
        problems = []
        if not self.api_keys:
            problems.append("MAEC_API_KEYS is empty (every endpoint but health needs a key)")
        if self.storage_backend == "s3":
            problems += [
                f"{env_name(f)}: S3 credentials are empty or a well-known default"
                for f in ("s3_access_key", "s3_secret_key")
                if getattr(self, f) in _DEFAULT_SECRETS
            ]
        if problems:
            raise ValueError(
                "insecure settings outside dev mode: " + "; ".join(problems)
                + " (set MAEC_DEV_MODE=true only for a local, single-user run)"
            )
        return self

    @property
    def docs_need_key(self) -> bool:
        return not self.dev_mode if self.docs_require_key is None else self.docs_require_key

    @property
    def key_lookup(self) -> dict[str, str]:
        """hash -> key id, so authenticating a request is one dict lookup."""
        return {digest: key_id for key_id, digest in self.api_keys.items()}

    @property
    def own_pool(self) -> str:
        """This worker's pool: MAEC_WORKER_POOL, else the first of MAEC_POOLS."""
        return self.worker_pool if self.worker_pool is not None else next(iter(self.pools))

    def priority_cap(self, key_id: str) -> Priority:
        return self.priority_caps.get(key_id, self.priority_cap_default)

    def warn_if_dev(self) -> None:
        if self.dev_mode:
            log.warning(
                "#### MAEC DEV MODE: authentication is OFF; every request acts as key "
                f"{DEV_OWNER!r}. "
                "Never expose this process beyond 127.0.0.1. ####"
            )


def describe(exc: ValidationError) -> str:
    """One line per problem, ``MAEC_<NAME>: what is wrong``, never the value."""
    problems = []
    for err in exc.errors(include_url=False, include_input=False, include_context=False):
        loc = [str(p) for p in err["loc"]]
        where = env_name(loc[0]) + (f" ({'.'.join(loc[1:])})" if loc[1:] else "") \
            if loc else ""
        msg = err["msg"].removeprefix("Value error, ")
        problems.append(f"{where}: {msg}" if where else msg)
    return "invalid settings: " + "; ".join(problems)


_UNPARSABLE = re.compile(r'field "(\w+)"')


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings; ``SettingsInvalid`` (values never repeated) otherwise."""
    try:
        return Settings()
    except ValidationError as exc:
        raise SettingsInvalid(describe(exc)) from None
    except SettingsError as exc:
        # An environment value that is not the JSON its type needs (a list or a map).
        m = _UNPARSABLE.search(str(exc))
        name = env_name(m.group(1)) if m else "a MAEC_ variable"
        raise SettingsInvalid(f"invalid settings: {name} is not valid JSON for its type "
                              "(e.g. MAEC_API_KEYS='{\"alice\": \"<sha256>\"}')") from None
