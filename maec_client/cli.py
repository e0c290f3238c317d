"""The ``maec`` script: ``maec jobs ...`` (the merge service from the shell, over
maec_client.Client), plus whatever commands other installed distributions register under
the ``maec.commands`` entry point group (the merge library's ``merge``, ``extract``,
``combine``). Those are loaded only when asked for, so ``maec jobs`` never imports them.

Exit codes (stable; scripts branch on them):

    0  ok
    1  the job failed (``watch``, ``submit --wait``, ``download --wait``)
    2  usage or validation: bad flags/config, invalid recipe (422/413), DIR exists,
       job has nothing to download
    3  authentication (401)
    4  job or file not found (404)
    5  network, server (5xx, 429 after retries) or local I/O error
    6  checksum mismatch on download (nothing is left at DIR)
    7  job cancelled, or --timeout reached while waiting
    8  conflict (409): cancel of a job that already succeeded or failed, delete of a
       job still queued or running
  130  interrupted (Ctrl-C); a download resumes on the next run
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import threading
from collections.abc import Callable, Sequence
from functools import wraps
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, ParamSpec, TypeVar

import click
from tqdm import tqdm

from maec_client.errors import (
    ApiError,
    AuthError,
    ChecksumMismatch,
    ClientError,
    ConfigError,
    Conflict,
    DownloadError,
    JobCancelled,
    JobFailed,
    JobNotSucceeded,
    NotFound,
    ValidationFailed,
    WaitTimeout,
)
from maec_client.extensions import COMMANDS, registered
from maec_client.options import DownloadOptions, SubmitOptions, download_flags, submit_flags

# The HTTP client, its settings and the contract models are imported where a ``jobs``
# command needs them: ``maec merge`` (the merge library's command under this script)
# would otherwise pay about 0.2 s of CPU for httpx and pydantic-settings at every start.
if TYPE_CHECKING:
    from maec_client.client import Client
    from maec_client.models import Job

EXIT_OK = 0
EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_AUTH = 3
EXIT_NOT_FOUND = 4
EXIT_SERVER = 5
EXIT_CHECKSUM = 6
EXIT_CANCELLED = 7
EXIT_CONFLICT = 8
EXIT_INTERRUPTED = 130

# Most specific first: the first matching class decides the exit code.
_EXIT_CODES: list[tuple[type[BaseException], int]] = [
    (JobFailed, EXIT_JOB_FAILED),
    (ValidationFailed, EXIT_USAGE), (ConfigError, EXIT_USAGE), (DownloadError, EXIT_USAGE),
    (JobNotSucceeded, EXIT_USAGE),
    (AuthError, EXIT_AUTH),
    (NotFound, EXIT_NOT_FOUND),
    (ChecksumMismatch, EXIT_CHECKSUM),
    (JobCancelled, EXIT_CANCELLED), (WaitTimeout, EXIT_CANCELLED),
    (Conflict, EXIT_CONFLICT),
    (ClientError, EXIT_SERVER),
    (OSError, EXIT_SERVER),
]

P = ParamSpec("P")
R = TypeVar("R")


def exit_code_for(exc: BaseException) -> int:
    for cls, code in _EXIT_CODES:
        if isinstance(exc, cls):
            return code
    return EXIT_SERVER


# -- options shared by the group and every subcommand ---------------------------------
# Each may be given before or after the subcommand (``maec jobs --json list`` and
# ``maec jobs list --json``); the value is stored in ctx.obj, the later one wins.

def _store(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    if value is None or value is False:
        return
    obj = ctx.ensure_object(dict)
    obj[param.name or ""] = value


def _connection_options(f: Callable[P, R]) -> Callable[P, R]:
    opts = [
        click.option("--url", expose_value=False, callback=_store,
                     help="service URL (env MAEC_URL; default http://127.0.0.1:8000)"),
        click.option("--api-key", expose_value=False, callback=_store,
                     help="API key (env MAEC_API_KEY)"),
        click.option("--config", "config_file", expose_value=False, callback=_store,
                     type=click.Path(dir_okay=False),
                     help="config file (env MAEC_CONFIG; default "
                          "~/.config/maec/client.toml or client.yaml)"),
        click.option("--http-timeout", expose_value=False, callback=_store, type=float,
                     help="seconds per HTTP request (env MAEC_TIMEOUT; default 30)"),
        click.option("--json", "as_json", is_flag=True, expose_value=False,
                     callback=_store, help="machine-readable JSON on stdout"),
    ]
    for opt in reversed(opts):
        f = opt(f)
    return f


def _obj() -> dict[str, Any]:
    return click.get_current_context().ensure_object(dict)


def _as_json() -> bool:
    return bool(_obj().get("as_json"))


def _client() -> Client:
    from maec_client.client import Client
    from maec_client.config import resolve_config

    obj = _obj()
    config = resolve_config(url=obj.get("url"), api_key=obj.get("api_key"),
                            timeout=obj.get("http_timeout"),
                            config_file=obj.get("config_file"))
    # Tests and embedding tools inject a factory (e.g. a Client on a MockTransport).
    obj["resolved_config"] = config
    factory: Callable[..., Client] = obj.get("client_factory") or Client
    return factory(config=config)


def _emit(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=str))


def _fail(exc: BaseException) -> NoReturn:
    from maec_client.models import Job

    code = exit_code_for(exc)
    if isinstance(exc, ApiError):
        info: dict[str, Any] = exc.to_dict()
    else:
        info = {"code": getattr(exc, "code", type(exc).__name__), "message": str(exc),
                "details": getattr(exc, "details", {})}
        job = getattr(exc, "job", None)
        if isinstance(job, Job):
            info["job"] = job.model_dump(mode="json")
    if isinstance(exc, ClientError):
        info["message"] = exc.message
    config = _obj().get("resolved_config")
    if isinstance(exc, AuthError) and config is not None and not config.api_key:
        info["message"] += (" (no API key configured: use --api-key, MAEC_API_KEY or "
                            "api_key in the config file)")
    info["exit_code"] = code
    if _as_json():
        _emit({"error": info})
    else:
        click.echo(f"error: [{info['code']}] {info['message']}", err=True)
    sys.exit(code)


def _handles_errors(f: Callable[P, R]) -> Callable[P, R]:
    """Turn client exceptions into one line (or JSON) and the documented exit code."""

    @wraps(f)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return f(*args, **kwargs)
        except (ClientError, OSError) as exc:
            _fail(exc)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)

    return wrapper


# -- human output ---------------------------------------------------------------------

def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _summary(job: Job) -> str:
    lines = [f"id:        {job.id}", f"status:    {job.status}"
             + (" (cancel requested)" if job.cancel_requested and not job.done else "")]
    if job.stage:
        lines.append(f"stage:     {job.stage}")
    p = job.progress
    lines.append(f"progress:  {p.fraction:.0%}" + (f" ({p.done}/{p.total})" if p.total else ""))
    lines.append(f"method:    {job.method or '-'}" + (f"  name: {job.name}" if job.name else ""))
    for label, value in (("created", job.created_at), ("started", job.started_at),
                         ("finished", job.finished_at)):
        if value:
            lines.append(f"{label + ':':<10} {value}")
    if job.attempts > 1:
        lines.append(f"attempts:  {job.attempts}")
    if job.error:
        lines.append(f"error:     [{job.error.code}] {job.error.message}")
    if job.result:
        total = sum(f.size for f in job.result.files)
        lines.append(f"files:     {len(job.result.files)} ({_size(total)})")
    return "\n".join(lines)


def _show_progress(no_progress: bool) -> bool:
    # Bars only on a terminal: in CI logs and pipes they are noise, not information.
    return not no_progress and not _as_json() and sys.stderr.isatty()


class _JobBar:
    """A percent bar labelled with status/stage, fed by Client.wait's callback."""

    def __init__(self, show: bool) -> None:
        self._bar: tqdm[None] | None = (
            tqdm(total=100, unit="%", file=sys.stderr, dynamic_ncols=True,
                 bar_format="{desc}: {percentage:3.0f}%|{bar}| [{elapsed}]")
            if show else None)

    def __call__(self, job: Job) -> None:
        if self._bar is None:
            return
        self._bar.set_description_str(f"{job.id} {job.status}"
                                      + (f"/{job.stage}" if job.stage else ""))
        self._bar.update(round(job.progress.fraction * 100) - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def _wait(client: Client, job: Job | str, timeout: float | None, no_progress: bool) -> Job:
    bar = _JobBar(_show_progress(no_progress))
    try:
        return client.wait(job, timeout=timeout, on_progress=bar)
    finally:
        bar.close()


# -- commands -------------------------------------------------------------------------

@click.group("jobs")
@_connection_options
def jobs() -> None:
    """Submit, watch, list, cancel, download, pin and delete jobs; see the queue.

    The URL and API key come from --url/--api-key, else MAEC_URL/MAEC_API_KEY, else
    the config file (~/.config/maec/client.toml or .yaml: url, api_key, timeout).
    Exit codes: 0 ok, 1 job failed, 2 usage/validation, 3 auth, 4 not found,
    5 network/server, 6 checksum mismatch, 7 cancelled/timeout, 8 conflict.
    """


@jobs.command()
@click.argument("recipe", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--idempotency-key", help="resubmitting with the same key returns the same job")
@click.option("--name", help="a label for the job (shown in status and list)")
@click.option("--no-validate", is_flag=True, help="skip the local recipe check")
@submit_flags
@click.option("--wait", "wait_", is_flag=True, help="wait for the job to finish")
@click.option("--timeout", type=float, help="with --wait: give up after SECONDS (exit 7)")
@click.option("--no-progress", is_flag=True, help="no progress bar")
@_connection_options
@_handles_errors
def submit(recipe: str, idempotency_key: str | None, name: str | None, no_validate: bool,
           options: SubmitOptions, wait_: bool, timeout: float | None,
           no_progress: bool) -> None:
    """Queue RECIPE (a mergekit or MAEC recipe YAML, or a named-checkpoints job; - for stdin).

    Prints the job id (or the job as JSON).
    """
    source: str | Path
    if recipe == "-":
        text = sys.stdin.read()
        # One-line YAML on stdin must not be taken for a file name.
        source = text if "\n" in text else text + "\n"
    else:
        source = Path(recipe)
        if not source.is_file():
            raise ValidationFailed("invalid_recipe", f"recipe file {recipe} does not exist")
    with _client() as client:
        job = client.submit(source, idempotency_key=idempotency_key, name=name,
                            validate=not no_validate, pinned=options.pinned,
                            gguf=options.gguf)
        if wait_:
            if not _as_json():
                click.echo(job.id, err=True)
            job = _wait(client, job, timeout, no_progress)
    if _as_json():
        _emit(job.model_dump(mode="json"))
    else:
        click.echo(job.id if not wait_ else _summary(job))


@jobs.command()
@click.argument("job_id")
@_connection_options
@_handles_errors
def status(job_id: str) -> None:
    """Show one job."""
    with _client() as client:
        job = client.get(job_id)
    if _as_json():
        _emit(job.model_dump(mode="json"))
    else:
        click.echo(_summary(job))


@jobs.command()
@click.argument("job_id")
@click.option("--timeout", type=float, help="give up after SECONDS (exit 7)")
@click.option("--no-progress", is_flag=True, help="no progress bar")
@_connection_options
@_handles_errors
def watch(job_id: str, timeout: float | None, no_progress: bool) -> None:
    """Follow a job to its end with a live progress bar; exit code says how it ended."""
    with _client() as client:
        job = _wait(client, job_id, timeout, no_progress)
    if _as_json():
        _emit(job.model_dump(mode="json"))
    else:
        click.echo(_summary(job))


@jobs.command("list")
@click.option("--status", "status_", help="only jobs in this status")
@click.option("--limit", type=click.IntRange(min=1), default=20, show_default=True,
              help="at most this many jobs (newest first)")
@click.option("--all", "all_", is_flag=True, help="every job (follows all pages)")
@_connection_options
@_handles_errors
def list_(status_: str | None, limit: int, all_: bool) -> None:
    """List jobs, newest first."""
    with _client() as client:
        found = list(client.iter_jobs(status=status_, limit=None if all_ else limit))
    if _as_json():
        _emit({"jobs": [j.model_dump(mode="json") for j in found]})
        return
    if not found:
        click.echo("no jobs")
        return
    click.echo(f"{'ID':<28} {'STATUS':<11} {'STAGE':<8} {'DONE':>5}  {'METHOD':<16} CREATED")
    for j in found:
        click.echo(f"{j.id:<28} {j.status:<11} {j.stage or '-':<8} "
                   f"{j.progress.fraction:>5.0%}  {(j.method or '-'):<16} {j.created_at or '-'}")


@jobs.command()
@_connection_options
@_handles_errors
def queue() -> None:
    """Your queued and running jobs (each queued one's position and ETA) and every
    worker pool's load (GET /v1/queue)."""
    with _client() as client:
        summary = client.queue()
    if _as_json():
        _emit(summary.model_dump(mode="json"))
        return
    counts = summary.jobs
    click.echo(f"key {summary.key} ({summary.policy}): {counts.queued} queued, "
               f"{counts.running} running (cost {counts.running_cost})")
    for j in summary.queued:
        eta = "-" if j.eta_s is None else f"{j.eta_s:.0f}s"
        click.echo(f"  {j.id:<28} {j.priority:<7} position {j.position:<4} eta {eta:<7} "
                   f"pool {j.pool or '-'}")
    for name, pool in summary.pools.items():
        click.echo(f"pool {name}: {pool.queued} queued, {pool.active} active, "
                   f"{pool.workers} workers")


@jobs.command()
@click.argument("job_id")
@_connection_options
@_handles_errors
def cancel(job_id: str) -> None:
    """Ask a job to stop (queued jobs end at once; running ones within seconds)."""
    with _client() as client:
        job = client.cancel(job_id)
    if _as_json():
        _emit(job.model_dump(mode="json"))
    else:
        click.echo(f"{job.id}: {job.status}"
                   + (", cancel requested" if job.status != "cancelled" else ""))


@jobs.command()
@click.argument("job_id")
@click.option("--missing-ok", is_flag=True, help="exit 0 if the job is already gone")
@_connection_options
@_handles_errors
def delete(job_id: str, missing_ok: bool) -> None:
    """Delete a finished job and its files (exit 8 while it is queued or running:
    cancel it first; exit 4 if there is no such job)."""
    with _client() as client:
        client.delete(job_id, missing_ok=missing_ok)
    if _as_json():
        _emit({"job_id": job_id, "deleted": True})
    else:
        click.echo(f"{job_id}: deleted")


def _pin_command(name: str, pinned: bool, doc: str) -> None:
    @jobs.command(name, help=doc)
    @click.argument("job_id")
    @_connection_options
    @_handles_errors
    def command(job_id: str) -> None:
        with _client() as client:
            job = client.pin(job_id) if pinned else client.unpin(job_id)
        if _as_json():
            _emit(job.model_dump(mode="json"))
        else:
            click.echo(f"{job.id}: {'pinned' if job.pinned else 'not pinned'}")


_pin_command("pin", True, "Keep a job and its files past the retention period.")
_pin_command("unpin", False, "Let a pinned job expire again with the retention period.")


@jobs.command()
@click.argument("job_id")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@download_flags()
@click.option("--wait", "wait_", is_flag=True, help="wait for the job to finish first")
@click.option("--timeout", type=float, help="with --wait: give up after SECONDS (exit 7)")
@click.option("--no-progress", is_flag=True, help="no progress bar")
@_connection_options
@_handles_errors
def download(job_id: str, dest: Path, options: DownloadOptions, wait_: bool,
             timeout: float | None, no_progress: bool) -> None:
    """Download a succeeded job's files into DEST, verified against its manifest.

    Bytes land in DEST.partial first (rerun to resume after an interruption); DEST
    appears only once every file's sha256 matched.
    """
    with _client() as client:
        job = _wait(client, job_id, timeout, no_progress) if wait_ else client.get(job_id)
        client.download(job, dest, options, progress=_show_progress(no_progress))
    files = job.result.files if job.result else []
    if _as_json():
        _emit({"job_id": job.id, "dir": str(dest),
               "files": [f.model_dump(mode="json") for f in files]})
    else:
        click.echo(f"{dest}: {len(files)} files, {_size(sum(f.size for f in files))}, "
                   "sha256 verified")


class _Maec(click.Group):
    """``jobs`` here; every other command from an installed ``maec.commands`` entry point,
    imported only when that command (or the full command list) is needed."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(registered(COMMANDS)))

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        own = super().get_command(ctx, cmd_name)
        if own is not None:
            return own  # a plugin cannot shadow ``jobs``
        ep = registered(COMMANDS).get(cmd_name)
        if ep is None:
            return None
        try:
            command = _load(ep)
        except Exception as exc:
            # One broken plugin must not take ``maec jobs`` or ``maec --help`` down with it.
            click.echo(f"warning: command {cmd_name!r} ({ep.value}) cannot be loaded: "
                       f"{type(exc).__name__}: {exc}", err=True)
            return None
        if not isinstance(command, click.Command):
            click.echo(f"warning: {ep.value} is not a click command", err=True)
            return None
        return command

    def main(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Any:
        """As click's, but a run of the script itself (the arguments read from
        ``sys.argv``) ends with :func:`_end_process`: a caller that passes its own
        arguments (a test, an embedding tool) gets click's ``SystemExit`` as before."""
        if args is not None:
            return super().main(args, *rest, **kwargs)
        try:
            return super().main(args, *rest, **kwargs)
        except SystemExit as done:
            _end_process(done)


def _load(ep: EntryPoint) -> Any:
    """``ep``'s object, imported with the cyclic garbage collector off, and what the
    import built then left out of every later collection (``gc.freeze``): a command's
    library builds its models and options as it is imported, all kept for the whole run,
    and the collections they set off free nothing (for ``maec merge``, some 80 of them,
    about 14 ms of its start; re-enabled without the freeze, the first collection would
    walk them all). Reference counting frees the rest as before."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        return ep.load()
    finally:
        gc.freeze()
        if collecting:
            gc.enable()


def _end_process(done: SystemExit) -> NoReturn:
    """End the process now that the command has finished, skipping the interpreter's
    teardown: after ``maec merge`` that teardown is torch's (its operator registrations
    undone one by one, its static objects destroyed), about 0.1 s of a merge's wall time
    spent on memory the process is about to give back anyway. What the teardown would do
    that matters is done first: the atexit handlers run and stdout and stderr are
    flushed, with the same exit status. Where any of that cannot be done the same way (a
    thread of the command still running, which the interpreter would wait for; a status
    that is not a number; a stream that cannot be flushed), the normal exit happens."""
    code = done.code
    if code is not None and not isinstance(code, int):
        raise done
    if any(t.is_alive() and not t.daemon for t in threading.enumerate()
           if t is not threading.main_thread()):
        raise done
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:
        raise done from None
    os._exit(code or 0)


@click.group(cls=_Maec)
@click.version_option(package_name="maec-client")
def main() -> None:
    """Talk to the merge service (maec jobs) and, where the merge library is installed,
    merge checkpoints locally (maec merge, extract, combine)."""


main.add_command(jobs)

if __name__ == "__main__":
    main()
