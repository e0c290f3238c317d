"""A job's inputs fetched in part: a part of a split merge (``worker.split``), or an
attempt resuming from published shards (``worker.resume``), fetches of each checkpoint
only what its output shards read.

- First every source's small files (configs, index, tokenizer) whole, and each weight
  file's safetensors header (its first ``8 + n`` bytes) into a partial cache entry
  (``worker.inputs.InputCache``): enough to plan the merge and decide a split.
- Then, for a group of output shards, the byte ranges of the input tensors they read,
  as the engine's own shard plan names them (``maec_core.service.running.shard_reads``):
  ranged GETs pinned to the listed ETag on S3, ``pread`` of the pinned file on a local
  folder. A merge whose reads cannot be named that way (``NotSplittable``) fetches its
  weight files whole instead (:meth:`PartialInputs.complete`).

The engine is told which bytes are present (``EngineOptions.present``, read from each
partial entry's sidecar) and refuses to read any other (``InputRangeMissing``). The
published manifest names each input file's sha256 without a whole copy: the store's
own (an S3 object uploaded with a whole-object SHA-256; only such sources are fetched
in part), or, for a local folder, the pinned file hashed where it lies.

Which jobs fetch in part (:func:`fetches_in_part`): a resumable plain merge whose
sources all read byte ranges, and that is to be split (by its pinned sizes) or resumes
from published shards. Every other job fetches whole files, as before.
"""

from __future__ import annotations

import logging
import os
import re
import struct
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from app.disk_cache import Hold
from app.jobs.record import JobRecord
from app.settings import Settings
from app.sources import Source, SourceFile, SourceKind, check_not_service_storage, open_source
from app.sources.base import is_checkpoint_file
from app.storage.base import Storage
from maec_core.service import (
    MAX_HEADER_BYTES,
    CorruptCheckpoint,
    NotSplittable,
    Recipe,
    TensorMethod,
    get_method,
)
from maec_core.service.running import (
    RunContext,
    WrittenFile,
    planned_shard_count,
    run,
    shard_reads,
)
from worker.byte_ranges import covers, read_sidecar
from worker.inputs import DATA, PARTIAL, SIDECAR, InputCache, link_file
from worker.job_kind import Planned
from worker.stages import MergeJob

log = logging.getLogger("maec.worker")

_SHARD = re.compile(r"-(\d+)-of-(\d+)\.safetensors$")
# A part's (or a resumed attempt's) shards are made in this many runs, the next run's
# input ranges fetched while one merges (make_shards).
PIPELINE_GROUPS = 4


@dataclass
class _Weight:
    """One weight file of a source, held in part (or whole once completed)."""

    uri: str
    reader: SourceKind
    file: SourceFile
    local: Path  # its link in the job's input folder


@dataclass
class PartialInputs:
    """The job's inputs as held in part by this worker's cache (see the module
    docstring); ``local`` maps each reference to its input folder, as a whole fetch
    does."""

    cache: InputCache
    hold: Hold
    local: dict[str, str] = field(default_factory=dict)
    weights: list[_Weight] = field(default_factory=list)
    fetched: int = 0
    cached: int = 0
    # Inode of a partial entry's data file -> its sidecar.
    _sidecars: dict[tuple[int, int], Path] = field(default_factory=dict)
    _digests: ThreadPoolExecutor | None = None
    _pending: Future[dict[str, dict[str, str]]] | None = None

    def headers(self, uri: str, reader: SourceKind, files: list[SourceFile],
                dest: Path) -> None:
        """``uri``'s small files whole and its weight files' headers into ``dest``."""
        small = [f for f in files if not f.name.endswith(".safetensors")]
        got, hit = self.cache.fill(dest, small, reader.fetch, hold=self.hold)
        self.fetched, self.cached = self.fetched + got, self.cached + hit
        for f in files:
            if f.name.endswith(".safetensors"):
                w = _Weight(uri, reader, f, dest / f.name)
                self._ensure(w, [(0, min(8, f.size))])
                self._ensure(w, [(0, _header_end(w.local, f))])
                self.weights.append(w)
        self.local[uri] = str(dest)

    def _ensure(self, w: _Weight, want: list[tuple[int, int]]) -> None:
        path, got = self.cache.get_ranges(w.file.content_key, w.file.size, want,
                                          partial(w.reader.read_range, w.file), self.hold)
        self.fetched += got
        if not w.local.exists():
            w.local.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, w.local)  # never a copy: ranges fetched later must show
        st = path.stat()
        if path.name == DATA and path.parent.name.endswith(PARTIAL):  # else: whole
            self._sidecars[(st.st_dev, st.st_ino)] = path.parent / SIDECAR

    def ensure(self, recipe: Recipe, shards: Collection[int]) -> None:
        """The byte ranges the output shards ``shards`` of ``recipe`` (localised to
        ``local``) read, fetched where not held yet; a merge whose reads are not named
        by shard fetches its weight files whole."""
        if not shards:
            return
        try:
            reads = shard_reads(recipe, shards)
        except NotSplittable as exc:
            log.info("inputs fetched whole: %s", exc.message)
            self.complete()
            return
        by_inode = {_inode(w.local): w for w in self.weights}
        wanted: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for spans in reads.values():
            for s in spans:
                wanted.setdefault(_inode(s.file), []).append((s.start, s.end))
        for ino, ranges in wanted.items():
            w = by_inode.get(ino)
            if w is not None:  # else a file fetched whole
                self._ensure(w, ranges)

    def complete(self) -> None:
        """Every weight file whole (only the ranges not held yet fetched)."""
        for w in self.weights:
            path, got = self.cache.complete(w.file.content_key, w.file.size,
                                            partial(w.reader.read_range, w.file),
                                            w.reader.digest(w.file), self.hold)
            self.fetched += got
            if not path.samefile(w.local):
                w.local.unlink()
                link_file(path, w.local)

    def present(self, path: Path, start: int, end: int) -> bool:
        """Whether bytes ``[start, end)`` of the input file ``path`` are held (the
        engine's ``EngineOptions.present``): read from the entry's sidecar."""
        sidecar = self._sidecars.get(_inode(path))
        if sidecar is None:
            return True  # fetched whole
        return covers(read_sidecar(sidecar), start, end)

    def start_digests(self) -> None:
        """Begin finding the weight files' digests on a thread (a local folder's are
        hashed where they lie: a read as long as the files), so that they are ready
        when the manifest is written; :meth:`digests` waits for them."""
        if self._digests is None:
            self._digests = ThreadPoolExecutor(max_workers=1,
                                               thread_name_prefix="maec-digests")
            self._pending = self._digests.submit(self._find_digests)
            self._digests.shutdown(wait=False)

    def digests(self) -> dict[str, dict[str, str]]:
        """Each reference's weight files' sha256 (file name -> hex), known without
        hashing the partial copies (the published manifest's input digests)."""
        self.start_digests()
        assert self._pending is not None
        return self._pending.result()

    def _find_digests(self) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for w in self.weights:
            out.setdefault(w.uri, {})[w.file.name] = w.reader.digest(w.file)
        return out


def _inode(path: Path) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


def _header_end(path: Path, file: SourceFile) -> int:
    """Where a weight file's header ends (its first 8 bytes are held)."""
    if file.size < 8:
        raise CorruptCheckpoint(f"{file.name}: shorter than the 8-byte header length",
                                file=file.name)
    with open(path, "rb") as f:
        n = int(struct.unpack("<Q", f.read(8))[0])
    if n > MAX_HEADER_BYTES or 8 + n > file.size:
        raise CorruptCheckpoint(f"{file.name}: header length {n} is impossible",
                                file=file.name)
    return 8 + n


def shard_index(name: str) -> int:
    """An output shard's index in its plan, from its HF file name."""
    m = _SHARD.search(name)
    return int(m.group(1)) - 1 if m else 0


def shards_left(recipe: Recipe, done: Iterable[str]) -> list[int]:
    """The output shards of ``recipe`` (localised) not among the ``done`` file names."""
    n = planned_shard_count(recipe)
    if n is None:
        raise NotSplittable("the merge has no shard plan of a plain tensor method")
    skip = {shard_index(name) for name in done}
    return [i for i in range(n) if i not in skip]


def fetches_in_part(rec: JobRecord, job: Planned, settings: Settings, storage: Storage,
                    *, split: bool, resuming: bool) -> list[tuple[str, SourceKind,
                                                                 list[SourceFile]]] | None:
    """The job's sources (reference, reader, pinned files) when it is to fetch in part
    (see the module docstring): ``split`` (it may be split: its pinned inputs' size is
    above the pool's split size) or ``resuming`` (a resumed attempt, or a part of a split
    merge). None: whole files, as usual."""
    if not isinstance(job, MergeJob) or not job.resumable or not rec.sources:
        return None
    recipe = job.plan.recipe
    # A plain tensor method's merge: its reads are named by shard. A method that splits
    # in phases (MAEC) reads every tensor in its earlier phases: its inputs come whole.
    if not isinstance(get_method(recipe.merge_method), TensorMethod) or recipe.layered:
        return None
    sources = []
    for uri, doc in sorted(rec.sources.items()):
        source = check_not_service_storage(Source.from_dict(doc), settings)
        if job.one_file(uri) or not source.files:
            return None
        reader = open_source(source, storage)
        files = list(source.files)
        if not all(is_checkpoint_file(f.name) for f in files) or not reader.ranged_for(files):
            return None
        sources.append((uri, reader, files))
    size = sum(f.size for _uri, _r, files in sources for f in files)
    may_split = split and 0 < settings.split_above_bytes < size
    return sources if may_split or resuming else None


def fetch_headers(sources: list[tuple[str, SourceKind, list[SourceFile]]],
                  cache: InputCache, workdir: Path, hold: Hold) -> PartialInputs:
    """Every source's small files and weight headers (:meth:`PartialInputs.headers`),
    each into ``workdir/inputs/<i>`` as a whole fetch lays them out."""
    inputs = PartialInputs(cache, hold)
    # Room made as a whole fetch makes it: the partial entries count at their full size.
    cache.evict(keep_free=sum(f.size for _uri, _r, files in sources for f in files
                              if cache.lookup(f.content_key, f.size) is None))
    for i, (uri, reader, files) in enumerate(sources):
        reader.check_unchanged(files)  # a cache hit does not excuse a changed source
        inputs.headers(uri, reader, files, workdir / "inputs" / str(i))
    return inputs


def groups(shards: Iterable[int], size: int) -> list[tuple[int, int]]:
    """``shards`` (indices) as ranges ``[lo, hi)`` of consecutive indices, each of at
    most ``size`` shards."""
    out: list[tuple[int, int]] = []
    for i in sorted(set(shards)):
        if out and out[-1][1] == i and out[-1][1] - out[-1][0] < size:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def make_shards(recipe: Recipe, shards: Collection[int], inputs: PartialInputs, out: Path,
                ctx: RunContext, done: Mapping[str, WrittenFile]) -> dict[str, WrittenFile]:
    """Make the output shards ``shards`` of ``recipe`` (localised) into folders under
    ``out``, fetching their inputs' byte ranges as they go: the merge runs group after
    group of ``PIPELINE_GROUPS`` ranges, and the next group's ranges are fetched while
    one is merged, so the fetch and the merge overlap instead of adding up. Each group
    is one run of the engine (``EngineOptions.part``; ``done``: shards it skips), its
    shards handed to ``ctx.options.on_shard`` as they are written. Returns the shards
    made."""
    if not shards:
        return {}
    size = max(1, -(-len(shards) // PIPELINE_GROUPS))
    runs = groups(shards, size)
    made: dict[str, WrittenFile] = {}
    report = _monotonic(ctx.progress)

    def on_shard(path: Path, written: WrittenFile) -> None:
        made[written.path] = written
        if ctx.options.on_shard is not None:
            ctx.options.on_shard(path, written)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="maec-prefetch") as pool:
        inputs.ensure(recipe, range(*runs[0]))
        for k, (lo, hi) in enumerate(runs):
            ahead = (pool.submit(inputs.ensure, recipe, range(*runs[k + 1]))
                     if k + 1 < len(runs) else None)
            try:
                options = replace(ctx.options, part=(lo, hi), done_shards=dict(done) or None,
                                  present=inputs.present, on_shard=on_shard)
                run(recipe, out / f"g{k}", ctx.but(options=options, progress=report))
            finally:
                if ahead is not None:
                    ahead.result()  # its error, if any, is the attempt's
    return made


def _monotonic(progress: Callable[[str, int, int], None] | None
               ) -> Callable[[str, int, int], None] | None:
    """``progress`` that never reports a stage's count lower than it did: each group's
    run counts the tensors of the shards it skips as done, the later groups' included."""
    if progress is None:
        return None
    best: dict[str, int] = {}

    def report(stage: str, done: int, total: int) -> None:
        best[stage] = max(best.get(stage, 0), done)
        progress(stage, best[stage], total)

    return report
