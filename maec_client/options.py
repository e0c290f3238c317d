"""The client's options, declared once: how a client connects, how a download runs.

:class:`ClientOptions` (and :class:`AsyncClientOptions`) are the keyword arguments of
``Client(...)`` and ``AsyncClient(...)`` beyond the URL and key, typed, so a new
connection option is one line here and both clients take it. :class:`DownloadOptions` is
one download's settings: ``Client.download(job, dest, workers=4)`` builds it from keyword
arguments, the downloader passes it whole, and ``maec jobs download`` gets its flags
generated from the fields by :func:`download_flags` (each field's click declaration is
kept beside it), as the merge library's ``RunFlags`` does for ``maec merge``.

Imports click and nothing of the client's HTTP side.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar

import click

if TYPE_CHECKING:
    import httpx

    from maec_client.config import ClientConfig
    from maec_client.retry import RetryPolicy

MiB = 1 << 20
C = TypeVar("C", bound=Callable[..., Any])
# (bytes done, bytes in all) after each chunk written.
ByteCallback = Callable[[int, int], None]


class ConnectionOptions(TypedDict, total=False):
    """What both clients take: ``timeout`` (seconds per request) or a whole ``config``
    (the URL, key and timeout otherwise read from the environment and config file);
    ``retry`` the retry policy, whose ``max_retries`` and ``backoff`` the two shorthands
    override; ``clock`` for tests and embedding (a fake clock)."""

    timeout: float | None
    config: ClientConfig | None
    retry: RetryPolicy | None
    max_retries: int | None
    backoff: float | None
    clock: Callable[[], float]


class ClientOptions(ConnectionOptions, total=False):
    """``Client``'s options: the shared ones, plus an httpx ``transport`` (an
    httpx.MockTransport in tests) and the ``sleep`` that retries and polls wait with."""

    transport: httpx.BaseTransport | None
    sleep: Callable[[float], None]


class AsyncClientOptions(ConnectionOptions, total=False):
    """``AsyncClient``'s options: as Client's, with an async ``transport`` and ``sleep``,
    and the ``sync_transport`` its downloads (run by a sync client in a thread) use."""

    transport: httpx.AsyncBaseTransport | None
    sync_transport: httpx.BaseTransport | None
    sleep: Callable[[float], Awaitable[None]]


_UNITS = {"": 1, "B": 1, "K": 10**3, "KB": 10**3, "M": 10**6, "MB": 10**6, "G": 10**9,
          "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(value: str) -> int:
    """``64MiB``, ``30KB``, ``1048576``: the size syntax recipes use for shard sizes."""
    m = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)([A-Z]*)", value.strip().upper().replace(" ", ""))
    if m is None or m.group(2) not in _UNITS:
        raise click.BadParameter(f"{value!r} is not a size like '64MiB'")
    size = int(float(m.group(1)) * _UNITS[m.group(2)])
    if size < 1:
        raise click.BadParameter(f"{value!r} is less than one byte")
    return size


def _size_flag(ctx: click.Context, param: click.Parameter, value: str) -> int:
    return parse_size(value)


def _flag(*decls: str, **click_kwargs: Any) -> dict[str, Any]:
    """A field's click declaration, kept in the field's metadata (no metadata: the
    field has no flag, e.g. a callback only Python callers can give)."""
    return {"decls": decls, **click_kwargs}


@dataclass(frozen=True)
class DownloadOptions:
    """One download's settings.

    Files larger than ``part_size`` are split into ranges; all ranges of all files share
    ``workers`` threads. A range that fails retries from where it stopped, ``retries``
    times in a row without progress. ``redirect`` asks the service for 307s to presigned
    store URLs (S3 storage only) instead of proxying the bytes. ``overwrite`` replaces an
    existing destination (and another job's partial download). ``progress`` draws a bar
    on stderr; ``on_bytes`` is called with (done, total) bytes as they land.
    """

    workers: int = field(default=8, metadata=_flag(
        "--workers", type=click.IntRange(1, 64), default=8, show_default=True,
        help="parallel connections"))
    part_size: int = field(default=64 * MiB, metadata=_flag(
        "--part-size", default="64MiB", show_default=True, callback=_size_flag,
        help="files larger than this are fetched as parallel ranges"))
    overwrite: bool = field(default=False, metadata=_flag(
        "--overwrite", is_flag=True, help="replace an existing DEST"))
    redirect: bool = field(default=False, metadata=_flag(
        "--redirect", is_flag=True,
        help="fetch from presigned store URLs (S3 storage) instead of via the API"))
    retries: int = 5
    progress: bool = False
    on_bytes: ByteCallback | None = None

    def __post_init__(self) -> None:
        if self.workers < 1 or self.part_size < 1:
            raise ValueError("workers and part_size must be positive")

    @classmethod
    def of(cls, options: DownloadOptions | None = None, **fields: Any) -> DownloadOptions:
        """``options`` (default: the defaults) with ``fields`` replaced; an unknown
        field name is a TypeError, as a misspelt keyword argument is."""
        return dataclasses.replace(options or cls(), **fields)


@dataclass(frozen=True)
class SubmitOptions:
    """What ``maec jobs submit`` asks of a job beyond its recipe, as ``Client.submit``'s
    keyword arguments of the same names: ``pinned`` keeps it past the retention period;
    ``gguf`` also publishes the merged model as one GGUF file of that type (the body's
    ``output: {gguf: TYPE}``, spelt as a recipe spells it; docs/gguf.md)."""

    pinned: bool | None = None
    gguf: str | None = None


def submit_flags(command: C) -> C:
    """Decorate ``maec jobs submit`` with ``--pin`` and ``--gguf``; the command receives
    them as one ``options`` argument (a :class:`SubmitOptions`)."""
    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        pin, gguf = kwargs.pop("pin"), kwargs.pop("gguf")
        kwargs["options"] = SubmitOptions(pinned=True if pin else None, gguf=gguf)
        return command(*args, **kwargs)

    decorated: Any = click.option(
        "--gguf", metavar="TYPE",
        help="also publish the merged model as one GGUF file of TYPE (f16, bf16, q8_0, ...)",
    )(wrapper)
    decorated = click.option("--pin", is_flag=True,
                             help="keep the job past the retention period")(decorated)
    return decorated  # type: ignore[no-any-return]


def with_gguf_output(body: dict[str, Any], gguf: str | None) -> dict[str, Any]:
    """``body`` asking for a GGUF output of type ``gguf`` (unchanged when None): in the
    recipe's own ``output`` when it has one (the service refuses an output given both
    in the body and in the recipe), else in the body's."""
    if gguf is not None:
        recipe = body.get("recipe")
        target = recipe if isinstance(recipe, dict) and "output" in recipe else body
        target["output"] = {**(target.get("output") or {}), "gguf": gguf}
    return body


DOWNLOAD_FLAGS = tuple(f.name for f in dataclasses.fields(DownloadOptions) if f.metadata)


def download_flags(*names: str) -> Callable[[C], C]:
    """Decorate a click command with the flags of the :class:`DownloadOptions` fields
    ``names`` (in that order in ``--help``; all flagged fields when none are named); the
    command receives them as one ``options`` argument."""
    names = names or DOWNLOAD_FLAGS
    unknown = set(names) - set(DOWNLOAD_FLAGS)
    if unknown:
        raise ValueError(f"no download flag named {sorted(unknown)}")
    by_name = {f.name: f for f in dataclasses.fields(DownloadOptions)}

    def decorate(command: C) -> C:
        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            kwargs["options"] = DownloadOptions(**{n: kwargs.pop(n) for n in names})
            return command(*args, **kwargs)

        decorated: Any = wrapper
        for name in reversed(names):
            spec = dict(by_name[name].metadata)
            decorated = click.option(*spec.pop("decls"), name, **spec)(decorated)
        return decorated  # type: ignore[no-any-return]

    return decorate
