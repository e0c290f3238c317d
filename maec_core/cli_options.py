"""The run options the command-line tools share, declared once and turned into flags.

:class:`RunFlags` is the one model: each field is one flag (``--device``,
``--overwrite``, ``--cache-dir``, ``--no-progress``), its click declaration kept beside
it. :func:`run_flags` generates a command's flags from the fields it names and hands the
command one ``RunFlags`` (as ``flags``) instead of a parameter per flag; the command
then runs its job in the :class:`~maec_core.context.RunContext` the flags make
(:meth:`RunFlags.run`). A new shared option is a new field here, and every command
that names it gets the same flag.

Importing this module does not import torch.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import click
from tqdm import tqdm

from maec_core.context import RunContext
from maec_core.errors import MaecError

T = TypeVar("T")


def default_cache_dir() -> Path:
    """Where the command line keeps input digests and MAEC artifacts between runs:
    ``$XDG_CACHE_HOME/maec``, else ``~/.cache/maec`` (``--cache-dir`` or
    ``MAEC_CACHE_DIR`` choose another)."""
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(xdg) / "maec"


class Bars:
    """A tqdm bar per stage, fed by the engine's progress callback."""

    def __init__(self, unit: str = "tensor") -> None:
        self._bars: dict[str, tqdm[None]] = {}
        self._unit = unit

    def __call__(self, stage: str, done: int, total: int) -> None:
        bar = self._bars.get(stage)
        if bar is None:
            bar = self._bars[stage] = tqdm(total=total, desc=stage, unit=self._unit,
                                          file=sys.stderr, dynamic_ncols=True)
        bar.update(done - bar.n)

    def close(self) -> None:
        for bar in self._bars.values():
            bar.close()


def _flag(*decls: str, **click_kwargs: Any) -> Any:
    """A field's click declaration, kept in the field's metadata."""
    return {"decls": decls, **click_kwargs}


@dataclass(frozen=True)
class RunFlags:
    """The shared run options of one command line, one field per flag.

    ``declared`` names the flags the command has (a command without ``--cache-dir``
    keeps no digests between runs). In a help text, ``{target}`` is the command's
    output argument (OUT_DIR, ARTIFACT_DIR, ...).
    """

    device: str | None = field(default=None, metadata=_flag(
        "--device", default=None, help="cuda, cpu, ... (default: CUDA when present)"))
    overwrite: bool = field(default=False, metadata=_flag(
        "--overwrite", is_flag=True, help="replace an existing {target}"))
    no_progress: bool = field(default=False, metadata=_flag(
        "--no-progress", is_flag=True, help="no progress {bars}"))
    cache_dir: Path | None = field(default=None, metadata=_flag(
        "--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
        envvar="MAEC_CACHE_DIR",
        help="keeps input digests and MAEC artifacts between runs "
             "(default: $XDG_CACHE_HOME/maec or ~/.cache/maec)"))
    declared: frozenset[str] = frozenset()

    @property
    def cache(self) -> Path:
        """The cache folder: ``--cache-dir``, else :func:`default_cache_dir`."""
        return self.cache_dir or default_cache_dir()

    def context(self, progress: Bars | None = None) -> RunContext:
        """The run context these flags make (digests kept under the cache folder when
        the command has ``--cache-dir``)."""
        return RunContext(progress=progress, device=self.device, overwrite=self.overwrite,
                          hash_cache=(self.cache / "sha256" if "cache_dir" in self.declared
                                      else None))

    def run(self, job: Callable[[RunContext], T], unit: str = "tensor") -> T:
        """Run ``job`` in :meth:`context`, with progress bars (unless ``--no-progress``);
        a MaecError exits 2 with its message."""
        bars = None if self.no_progress else Bars(unit)
        try:
            return job(self.context(bars))
        except MaecError as exc:
            error = exc
        finally:
            # Bars closed first, so the error line is not drawn over.
            if bars is not None:
                bars.close()
        click.echo(f"error: {error}", err=True)
        sys.exit(2)


FLAG_NAMES = tuple(f.name for f in dataclasses.fields(RunFlags) if f.metadata)
C = TypeVar("C", bound=Callable[..., Any])


def run_flags(*names: str, target: str = "OUT_DIR", bars: str = "bar") -> Callable[[C], C]:
    """Decorate a click command with the flags of the :class:`RunFlags` fields ``names``
    (in that order in ``--help``); the command receives them as one ``flags`` argument."""
    unknown = set(names) - set(FLAG_NAMES)
    if unknown:
        raise ValueError(f"no run flag named {sorted(unknown)}")
    by_name = {f.name: f for f in dataclasses.fields(RunFlags)}

    def decorate(command: C) -> C:
        @functools.wraps(command)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            given = {n: kwargs.pop(n) for n in names}
            kwargs["flags"] = RunFlags(**given, declared=frozenset(names))
            return command(*args, **kwargs)

        decorated: Any = wrapper
        for name in reversed(names):
            spec = dict(by_name[name].metadata)
            decls = spec.pop("decls")
            spec["help"] = spec["help"].format(target=target, bars=bars)
            decorated = click.option(*decls, name, **spec)(decorated)
        return decorated  # type: ignore[no-any-return]

    return decorate
