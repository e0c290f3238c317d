"""A job's plan, decided once from its recipe: what it reads, how its progress is shared,
what it evaluates and which adapter checks its inputs get (torch-free).

The worker builds one :class:`JobPlan` per attempt and carries it through its stages:
fetch (:attr:`JobPlan.inputs`, each a folder or one file), merge (the recipe pointing at
the fetched copies, :meth:`JobPlan.localised`, once :attr:`JobPlan.adapters` passed),
evaluate, and publish. The run is given each local copy's reference once
(:meth:`JobPlan.names`, as ``RunContext.names``) and returns its manifest and report
already named by reference; :func:`published_manifest` adds each input's digests.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maec_core.checksums import sha256_file
from maec_core.errors import CheckpointError
from maec_core.io.folder import is_adapter_folder
from maec_core.job_progress import StageSpans, job_spans
from maec_core.methods import get_method
from maec_core.recipe import Recipe
from maec_core.sweep.inputs import eval_sources, with_eval_sources


@dataclass(frozen=True)
class Joined:
    """mergekit's ``base+adapter`` reference: a LoRA adapter applied to the base named
    before the ``+``. A job fetches the two as separate inputs and joins them again for
    the merge. In a job, a ``+`` in a checkpoint reference always means this."""

    ref: str
    base: str
    adapter: str

    @staticmethod
    def of(ref: str) -> Joined | None:
        base, plus, adapter = ref.rpartition("+")
        return Joined(ref, base, adapter) if plus and base and adapter else None

    def refused(self) -> CheckpointError:
        """The error for parts that are not a full checkpoint and an adapter of it."""
        return CheckpointError(f"{self.ref}: a base+adapter reference joins a full "
                               "checkpoint and the LoRA adapter folder applied to it",
                               reference=self.ref)


@dataclass(frozen=True)
class AdapterCheck:
    """A LoRA adapter input applies only to a full checkpoint: the recipe's base, or the
    base a ``base+adapter`` reference names. Submission refuses other recipes; checked
    again on the fetched folders so that a job record that got past it cannot lead the
    engine (which follows an adapter config's base for local command-line use) to a path
    on the worker's machine."""

    base: str | None
    checkpoints: tuple[str, ...]
    joined: tuple[Joined, ...] = ()

    def check(self, local: Mapping[str, str] | None = None) -> None:
        """Raise CheckpointError when an input is an adapter without a full base;
        ``local`` maps references to the folders that hold them (else they are paths)."""
        where = local or {}

        def folder(ref: str) -> Path:
            return Path(where.get(ref, ref))

        for j in self.joined:
            if is_adapter_folder(folder(j.base)) or not is_adapter_folder(folder(j.adapter)):
                raise j.refused()
        own = {j.adapter for j in self.joined}
        adapters = [r for r in self.checkpoints
                    if r not in own and is_adapter_folder(folder(r))]
        if not adapters:
            return
        if self.base is None or is_adapter_folder(folder(self.base)):
            raise CheckpointError(
                "a LoRA adapter input applies only to the recipe's base model, which must "
                "be a full checkpoint; name its base in the recipe (base_model)",
                adapters=len(adapters))


@dataclass(frozen=True)
class JobPlan:
    """What one job does, by the recipe's references (``recipe`` as submitted)."""

    recipe: Recipe
    # Checkpoint folders, in recipe order (base first), no repeats; a ``base+adapter``
    # reference counts as its two parts.
    checkpoints: tuple[str, ...]
    # One-file inputs: ability corpora, then eval sets and few-shot files.
    corpora: tuple[str, ...]
    eval_inputs: tuple[str, ...]
    # Whether the method extracts (ability vectors an artifact store may hold).
    extracts: bool
    spans: StageSpans
    adapters: AdapterCheck
    # A tokenizer donor: the checkpoint the output vocabulary comes from when none of
    # its weights are merged (fetched and pinned like the others, its tokenizer read).
    tokenizers: tuple[str, ...] = ()

    @property
    def joined(self) -> tuple[Joined, ...]:
        return self.adapters.joined

    @property
    def inputs(self) -> tuple[str, ...]:
        """Every reference the job reads, no repeats."""
        return tuple(dict.fromkeys((*self.checkpoints, *self.tokenizers, *self.corpora,
                                    *self.eval_inputs)))

    def one_file(self, ref: str) -> bool:
        """Whether ``ref`` is read as one file (else a checkpoint folder)."""
        return ref in self.corpora or ref in self.eval_inputs

    def local_refs(self, local: Mapping[str, str]) -> dict[str, str]:
        """``local`` (each input's local copy) plus each ``base+adapter`` reference joined
        from its two parts' copies."""
        return {**local, **{j.ref: f"{local[j.base]}+{local[j.adapter]}"
                            for j in self.joined}}

    def localised(self, local: Mapping[str, str]) -> Recipe:
        """The recipe with every reference (eval sets too) replaced by its local copy."""
        refs = self.local_refs(local)
        return with_eval_sources(self.recipe.with_sources(refs), refs)

    def names(self, local: Mapping[str, str]) -> dict[str, str]:
        """Each local copy (and joined ``base+adapter`` pair of copies) -> the reference it
        stands for: what the run records and returns instead of the copy
        (``RunContext.names``)."""
        return {path: ref for ref, path in self.local_refs(local).items()}


def plan_job(recipe: Recipe) -> JobPlan:
    """The plan of ``recipe`` (parsed and validated)."""
    refs = recipe.sources()
    named = list(dict.fromkeys(s.ref for s in refs if s.kind == "checkpoint"))
    joined = tuple(j for j in map(Joined.of, named) if j is not None)
    parts = {j.ref: (j.base, j.adapter) for j in joined}
    checkpoints = tuple(dict.fromkeys(p for ref in named for p in parts.get(ref, (ref,))))
    # The method's own stages say whether it extracts before it combines.
    extracts = get_method(recipe.merge_method).extracts()
    return JobPlan(
        recipe=recipe, checkpoints=checkpoints,
        corpora=tuple(sorted({s.ref for s in refs if s.kind == "corpus"})),
        eval_inputs=tuple(eval_sources(recipe)), extracts=extracts,
        spans=job_spans(extracts=extracts,
                        evaluates=bool(recipe.evaluate) and recipe.sweep is None),
        adapters=AdapterCheck(recipe.base_model, checkpoints, joined),
        tokenizers=(recipe.tokenizer_donor,) if recipe.tokenizer_donor else ())


def published_manifest(manifest: Mapping[str, Any], refs: Iterable[str],
                       local: Mapping[str, str], hash_cache: Path | None = None,
                       known: Mapping[str, Mapping[str, str]] | None = None
                       ) -> dict[str, Any]:
    """``manifest`` (a run's, already naming its inputs by reference: ``RunContext.names``)
    as clients see it: ``inputs`` names each of ``refs`` by its reference with every file's
    sha256, read from the local copy ``local`` maps it to, unless ``known`` (reference ->
    file name -> sha256) gives it: a copy held only in part is never hashed. Any kind of
    job (a merge, an MoE build)."""
    inputs = {ref: {"files": input_digests(Path(local[ref]), hash_cache,
                                           (known or {}).get(ref))} for ref in refs}
    return {**manifest, "inputs": inputs}


def input_digests(path: Path, hash_cache: Path | None = None,
                  known: Mapping[str, str] | None = None) -> dict[str, str]:
    """``{file name: sha256}`` of an input: one file, or every file of a folder (names
    relative to it); ``known`` digests are taken as given. Digests are remembered
    (``maec_core.checksums``), so the files the merge already hashed are not read again."""
    given = known or {}
    if path.is_file():
        return {path.name: given.get(path.name) or sha256_file(path, cache=hash_cache)}
    return {name: given.get(name) or sha256_file(f, cache=hash_cache)
            for f in sorted(path.rglob("*")) if f.is_file()
            for name in (f.relative_to(path).as_posix(),)}

