"""Sources swapped after they were checked: a job is checked at submission but its
sources are read later, by a worker. Whatever changes in between (a folder swapped for
a link out of its root, a shard rewritten or swapped for a link, a corpus or an eval set
swapped, an S3 object overwritten) must end the job ``failed`` with ``source_changed``, with nothing
published and no byte from outside the allow-listed root in the worker's cache.

The jobs are submitted while no worker runs, the sources changed, then a worker started:
the swap lands exactly between the check and the fetch. An unchanged job in the same
batch succeeds (the pins do not refuse what did not change).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.reliability import helpers as h
from tests.reliability import results
from tests.stack import S3_INPUTS_BUCKET, S3Server, Stack, stack_context

pytestmark = [pytest.mark.faults, pytest.mark.integration]

ENV = {"MAEC_MAX_ACTIVE_JOBS_PER_KEY": "1000", "MAEC_SUBMISSIONS_PER_MINUTE": "100000",
       "MAEC_RATE_LIMIT_PER_MINUTE": "100000", "MAEC_RATE_LIMIT_BURST": "10000"}


@pytest.fixture(scope="module")
def st(tmp_path_factory: pytest.TempPathFactory, s3_server: S3Server,
       model_root: Path) -> Iterator[Stack]:
    # No worker yet: each test submits, swaps, then starts one.
    with stack_context(tmp_path_factory.mktemp("toctou"), None, storage="s3", s3=s3_server,
                       workers=0, local_roots=[model_root], env=ENV) as stack:
        yield stack


@dataclass
class Case:
    name: str
    body: dict[str, Any]
    swap: Callable[[], None]


def _linear(donor: Path | str, base: Path) -> dict[str, Any]:
    return {"method": "linear", "ability_donor": [str(donor)], "language_base": str(base)}


def _cases(tiny: dict[str, Path], model_root: Path, outside: Path, s3: S3Server
           ) -> list[Case]:
    """Each case's job body and the change made after its submission."""
    from tests.factories import make_llama

    # Compatible, so only the swap check can refuse it; its own bytes, so the cache can
    # be searched for them.
    secret = make_llama(outside / "secret-model", seed=7, like=tiny["base"])
    (outside / "secret.txt").write_text("w4 w5 w6\n" * 10)
    copies = {n: model_root / f"toctou-{n}" for n in ("folder", "rewrite", "link", "ok")}
    for folder in copies.values():
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(tiny["a"], folder)
    corpus = model_root / "toctou-corpus.txt"
    corpus.write_text("w1 w2 w3\n" * 10)
    eval_set = model_root / "toctou-eval.jsonl"
    eval_set.write_text('{"text": "w1 w2 w3 w1 w2"}\n' * 4)
    s3_uri = s3.upload_folder(tiny["a"], "toctou/a")
    shard = "model.safetensors"

    def folder_to_link() -> None:
        copies["folder"].rename(model_root / "toctou-folder-old")
        copies["folder"].symlink_to(secret)

    def shard_rewritten() -> None:
        (copies["rewrite"] / shard).write_bytes((tiny["b"] / shard).read_bytes())

    def shard_to_link() -> None:
        (copies["link"] / shard).unlink()
        (copies["link"] / shard).symlink_to(secret / shard)

    def corpus_to_link() -> None:
        corpus.unlink()
        corpus.symlink_to(outside / "secret.txt")

    def eval_set_to_link() -> None:
        eval_set.unlink()
        eval_set.symlink_to(outside / "secret.txt")

    def s3_overwritten() -> None:
        s3.client().upload_file(str(tiny["b"] / shard), S3_INPUTS_BUCKET,
                                  f"toctou/a/{shard}")

    maec = {"method": "maec", "base": str(tiny["base"]), "ability_donor": [str(tiny["a"])],
            "language_base": str(tiny["b"]), "ability_corpus": str(corpus),
            "parameters": {"importance": "gradient"}}
    base = tiny["base"]
    return [Case("folder_swapped_for_link", _linear(copies["folder"], base), folder_to_link),
            Case("shard_rewritten", _linear(copies["rewrite"], base), shard_rewritten),
            Case("shard_swapped_for_link", _linear(copies["link"], base), shard_to_link),
            Case("corpus_swapped_for_link", maec, corpus_to_link),
            Case("eval_set_swapped_for_link",
                 {**_linear(tiny["a"], base), "evaluate": [
                     {"name": "ppl", "language": "sw", "kind": "perplexity",
                      "path": str(eval_set)}]}, eval_set_to_link),
            Case("s3_object_overwritten", _linear(s3_uri, base), s3_overwritten)]


def test_sources_changed_after_submission_fail_the_job(
        st: Stack, s3_server: S3Server, tiny: dict[str, Path], model_root: Path,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    outside = tmp_path_factory.mktemp("outside-the-roots")
    cases = _cases(tiny, model_root, outside, s3_server)
    jobs = {c.name: st.submit({**c.body, "name": c.name})["id"] for c in cases}
    control = st.submit({**_linear(model_root / "toctou-ok", tiny["base"]),
                         "name": "unchanged"})["id"]
    # The record keeps each source with the files it held when it was checked.
    from app.sources.base import is_checkpoint_file

    want = {p.name for p in tiny["a"].iterdir() if is_checkpoint_file(p.name)}
    for doc in h.record(st, jobs["s3_object_overwritten"])["sources"].values():
        assert {f["name"] for f in doc["files"]} >= {"config.json", "model.safetensors"}
        assert all(f["version"] for f in doc["files"]), doc
        if doc["kind"] == "s3":
            assert {f["name"] for f in doc["files"]} == want
    for c in cases:
        c.swap()
    st.start_worker()
    done = {c.name: st.wait(jobs[c.name], timeout=120) for c in cases}
    refused = [n for n, job in done.items()
               if job["status"] == "failed" and job["error"]["code"] == "source_changed"
               and job["result"] is None and not h.job_keys(s3_server, job["id"])]
    results.add("toctou_cases", len(cases))
    results.add("toctou_refused", len(refused))
    assert refused == [c.name for c in cases], {
        n: (j["status"], j["error"]) for n, j in done.items() if n not in refused}
    ok = st.wait(control, timeout=120)
    assert ok["status"] == "succeeded", ok["error"]
    # No byte from outside the root reached the worker's cache.
    secrets = {(outside / "secret-model" / "model.safetensors").read_bytes(),
               (outside / "secret.txt").read_bytes()}
    objects = st.root / "work" / "cache" / "objects"
    held = {p.read_bytes() for p in objects.iterdir() if p.is_file()}
    assert not held & secrets
    h.audit(st, s3_server, [*jobs.values(), control], h.worker_logs(st))
