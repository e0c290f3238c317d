"""Hub sources (``hf://owner/name@<sha>``) against a fake Hub on 127.0.0.1.

The repos are the session's tiny Llama checkpoints, served by ``tests/fakehub.py`` with
the requests ``huggingface_hub`` really makes; the donor repo also holds what must never
be fetched: a pickle whose unpickling leaves a marker, a ``random.py`` that would too, a
stray JSON file and a sub-folder with more weights. Submission goes through the real app
(TestClient, real Redis); jobs run in-process with ``JobRunner``. Worker fetches go
through the real ``InputCache``; what was downloaded is read from the fake's request log
and what is cached from the cache folder's bytes, as a user would check them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from app.queue import QUEUE
from app.sources import Source
from app.storage.base import StorageError
from app.storage.local import LocalStorage
from maec_core.errors import SourceNotFound
from tests import hostile
from tests.api.conftest import Api
from tests.conftest import TinyModels
from tests.factories import make_llama
from tests.fakehub import FakeHub, HubRequest, fake_hub, fake_sha
from worker.inputs import InputCache, fetch_source
from worker.runner import JobRunner

# What a checkpoint folder is made of (the files the service may read or fetch).
CHECKPOINT = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
              "tokenizer_config.json", "special_tokens_map.json"}
# In the donor repo, never to be requested in any way.
NEVER = {"pytorch_model.bin", "random.py", "trainer_state.json",
         "original/consolidated.safetensors"}
TOKEN = "hf_fake_token_0123456789"


@dataclass(frozen=True)
class Repos:
    root: Path
    folders: dict[str, Path]  # repo id -> the folder it is served from

    def markers(self) -> list[Path]:
        return [self.root / "pickle.RAN", self.root / "code.RAN"]


@pytest.fixture(scope="module")
def repos(tiny_models: TinyModels, tmp_path_factory: pytest.TempPathFactory) -> Repos:
    root = tmp_path_factory.mktemp("hub-repos")
    folders: dict[str, Path] = {}
    for repo, src in (("org/base", tiny_models.base), ("org/donor", tiny_models.donor),
                      ("org/lang", tiny_models.lang), ("org/private", tiny_models.donor2)):
        folders[repo] = Path(shutil.copytree(src, root / repo.replace("/", "--")))
    donor = folders["org/donor"]
    (donor / "pytorch_model.bin").write_bytes(hostile.payload_bytes(root / "pickle.RAN"))
    (donor / "random.py").write_text(f"open({str(root / 'code.RAN')!r}, 'w')\n")
    (donor / "trainer_state.json").write_text('{"log_history": []}' + " " * 100_000)
    (donor / "original").mkdir()
    shutil.copyfile(donor / "model.safetensors", donor / "original" / "consolidated.safetensors")
    # Another architecture: three layers where the others have two.
    folders["org/deep"] = make_llama(root / "org--deep", 7, num_hidden_layers=3)
    return Repos(root, folders)


@pytest.fixture
def hub(repos: Repos, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with fake_hub(monkeypatch, tmp_path / "hf-home") as h:
        for repo, folder in repos.folders.items():
            h.add_repo(repo, folder, token=TOKEN if repo == "org/private" else None)
        yield h
    for marker in repos.markers():
        assert not marker.exists(), f"{marker.name}: a hub file was executed"


@pytest.fixture
def api(api_factory: Callable[..., Api]) -> Api:
    return api_factory(hub_enabled=True)


def _body(hub: FakeHub, donor: str = "org/donor", **kw: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"method": "task_arithmetic", "base": hub.uri("org/base"),
                            "ability_donor": [hub.uri(donor)],
                            "language_base": hub.uri("org/lang")}
    body.update(kw)
    return body


def _post(api: Api, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    r = api.client.post("/v1/jobs", json=body, headers=api.auth())
    return r.status_code, dict(r.json())


def _header_end(path: Path) -> int:
    """The offset of the last byte of a safetensors file's header (length prefix included)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return 8 + int(n) - 1


def _span(rng: str | None) -> tuple[int, int]:
    m = re.fullmatch(r"bytes=(\d+)-(\d+)", rng or "")
    assert m is not None, f"not a bounded range: {rng!r}"
    return int(m.group(1)), int(m.group(2))


def _check_header_only(repos: Repos, log: list[HubRequest]) -> None:
    """Every request for weights is a GET of a range within the file's header."""
    weights = [r for r in log if r.file is not None and r.file.endswith(".safetensors")]
    assert weights and any(r.origin == "cdn" for r in weights)  # the redirect was followed
    sent: dict[tuple[str, str], int] = {}
    for r in weights:
        assert r.repo is not None and r.file is not None and r.method == "GET", r
        first, last = _span(r.range)
        assert 0 <= first <= last <= _header_end(repos.folders[r.repo] / r.file), r
        sent[r.repo, r.file] = sent.get((r.repo, r.file), 0) + r.sent
    for (repo, name), n in sent.items():
        size = (repos.folders[repo] / name).stat().st_size
        assert n <= _header_end(repos.folders[repo] / name) + 1 < size, (repo, name, n)


def test_submission_reads_only_headers_from_the_hub(api: Api, hub: FakeHub,
                                                     repos: Repos) -> None:
    status, job = _post(api, _body(hub))
    assert status == 202, job
    assert job["status"] == "queued" and api.r.llen(QUEUE) == 1
    assert job["recipe"]["models"][0]["model"] == hub.uri("org/donor")
    log = hub.log()
    _check_header_only(repos, log)
    # Nothing but the checkpoint's own files, and only at the pinned commit.
    asked = {r.file for r in log if r.file is not None}
    assert asked <= CHECKPOINT and not asked & NEVER, asked
    for r in log:
        assert r.status < 400, r
        if r.origin == "hub":
            assert hub.repos[r.repo or ""].sha in r.path, r
    # The side files are sniffed, not downloaded: only config.json comes whole.
    whole = {r.file for r in log if r.file and r.method == "GET" and r.range is None}
    assert whole == {"config.json"}, whole


def test_unknown_revision_or_repo_is_source_not_found(api: Api, hub: FakeHub) -> None:
    for donor in ("hf://org/donor@" + fake_sha("a commit the hub never had"),
                  "hf://org/no-such-model@" + fake_sha("x")):
        status, doc = _post(api, {**_body(hub), "ability_donor": [donor]})
        assert status == 422 and doc["code"] == "source_not_found", doc
        assert donor in doc["message"] and doc["details"]["source"] == donor
        assert api.r.llen(QUEUE) == 0 and not api.r.keys("maec:job:*")
        assert hub.log()[-1].status in (401, 404), hub.log()[-1]  # the hub was asked
    # The hub said 404 / RepoNotFound; the service is none the worse for it.
    assert api.client.get("/healthz").status_code == 200
    status, job = _post(api, _body(hub))
    assert status == 202, job
    assert api.r.llen(QUEUE) == 1


def test_architecture_mismatch_is_refused_as_for_local_paths(api: Api, hub: FakeHub,
                                                              repos: Repos) -> None:
    local = api.root / "extra" / "deep"
    shutil.copytree(repos.folders["org/deep"], local)
    r = api.client.post("/v1/jobs", json=api.named(ability_donor=[str(local)]),
                        headers=api.auth())
    assert r.status_code == 422 and r.json()["code"] == "incompatible_checkpoints", r.text
    status, doc = _post(api, _body(hub, donor="org/deep"))
    assert (status, doc["code"]) == (r.status_code, r.json()["code"]), doc
    assert api.r.llen(QUEUE) == 0
    _check_header_only(repos, hub.log())


@pytest.mark.parametrize("case", [
    hostile.pickle_only, hostile.pickle_shard_in_index, hostile.truncated,
    hostile.shorter_than_length_prefix, hostile.header_not_json, hostile.quantized_int8,
    hostile.tokenizer_json_is_pickle, hostile.tokenizer_model_is_torch_zip,
], ids=lambda f: f.__name__)
def test_hostile_repos_are_refused_from_headers_as_local_paths_are(
        api: Api, hub: FakeHub, repos: Repos, case: Callable[[Path, Path], Path]) -> None:
    bad = case(api.models.donor, api.root / "extra" / case.__name__)
    r = api.client.post("/v1/jobs", json=api.named(ability_donor=[str(bad)]),
                        headers=api.auth())
    assert r.status_code == 422, r.text
    hub.add_repo("org/bad", bad)
    status, doc = _post(api, _body(hub, donor="org/bad"))
    assert (status, doc["code"]) == (422, r.json()["code"]), doc
    assert doc["details"].get("source", hub.uri("org/bad")) == hub.uri("org/bad"), doc
    assert "maec-headers-" not in str(doc)  # the API's temporary view stays private
    assert api.r.llen(QUEUE) == 0
    # Pickles are never requested; weights and side files only in header-sized ranges.
    for req in hub.log():
        if req.repo == "org/bad" and req.file is not None:
            assert not req.file.endswith((".bin", ".py")), req
            if req.file not in ("config.json", "model.safetensors.index.json"):
                first, last = _span(req.range)
                assert last - first < 64 * 1024, req
    assert not hostile.marker_path(bad).exists()


def test_private_repo_needs_the_token_which_never_reaches_the_cdn(
        api: Api, hub: FakeHub, repos: Repos, monkeypatch: pytest.MonkeyPatch) -> None:
    status, doc = _post(api, _body(hub, donor="org/private"))
    assert status == 422 and doc["code"] == "source_not_found", doc
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    hub.clear()
    status, job = _post(api, _body(hub, donor="org/private"))
    assert status == 202, job
    log = hub.log()
    mine = [r for r in log if r.repo == "org/private"]
    assert mine and all(r.authorized for r in mine if r.origin == "hub")
    assert not any(r.authorized for r in log if r.origin == "cdn")
    _check_header_only(repos, log)


def test_a_hub_ignoring_range_requests_is_refused_cleanly(api: Api, hub: FakeHub) -> None:
    hub.ignore_range = True
    status, doc = _post(api, _body(hub))
    assert status == 422 and doc["code"] == "invalid_source", doc
    assert "range" in doc["message"]
    assert api.r.llen(QUEUE) == 0


def _source(hub: FakeHub, repo_id: str) -> Source:
    return Source("hf", hub.uri(repo_id), repo=repo_id, revision=hub.repos[repo_id].sha)


def _checkpoint(repos: Repos, repo_id: str) -> dict[str, bytes]:
    """The files a worker must fetch from ``repo_id``, by name."""
    folder = repos.folders[repo_id]
    return {n: (folder / n).read_bytes() for n in CHECKPOINT if (folder / n).is_file()}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _cached(cache: InputCache) -> dict[str, int]:
    """What the cache holds: {sha256 of an entry's bytes: entries holding them}; no
    temporary or partial file may be left beside the entries."""
    held: dict[str, int] = {}
    for p in cache.objects.iterdir():
        assert not p.name.startswith("."), f"left behind: {p.name}"
        digest = _sha(p.read_bytes())
        held[digest] = held.get(digest, 0) + 1
    return held


def _age(cache: InputCache, seconds: float = 100) -> None:
    """Make every entry ``seconds`` older (last use), so the next fetch is clearly later."""
    for p in cache.objects.iterdir():
        t = p.stat().st_mtime - seconds
        os.utime(p, (t, t))


def _same_files(folder: Path, files: dict[str, bytes]) -> None:
    got = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
    assert got == set(files), got
    for name, data in files.items():
        assert (folder / name).read_bytes() == data, name


def test_worker_fetch_is_exact_and_byte_identical(api: Api, hub: FakeHub,
                                                  repos: Repos, tmp_path: Path) -> None:
    repo = hub.repos["org/donor"]
    storage = LocalStorage(tmp_path / "storage")
    dest = tmp_path / "inputs" / "0"
    want = _checkpoint(repos, "org/donor")
    cache = InputCache(tmp_path / "cache", 10**9)
    path, fetched, cached = fetch_source(_source(hub, "org/donor"), storage, cache, dest)
    assert path == dest
    # Exactly the checkpoint files, nothing else (no client metadata folder either).
    _same_files(path, want)
    assert (fetched, cached) == (sum(len(d) for d in want.values()), 0)
    ours = load_file(str(path / "model.safetensors"))
    theirs = load_file(str(repos.folders["org/donor"] / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == theirs[k].dtype and ours[k].equal(theirs[k]) for k in ours)
    log = hub.log()
    # Each file downloaded once; weights from the CDN it is redirected to.
    assert hub.downloads("org/donor") == dict.fromkeys(want, 1)
    assert [r.origin for r in log if r.file == "model.safetensors" and r.status == 200] == ["cdn"]
    assert not {r.file for r in log} & NEVER
    assert all(repo.sha in r.path for r in log if r.origin == "hub")
    # The cache holds those bytes, once each.
    assert _cached(cache) == dict.fromkeys({_sha(d) for d in want.values()}, 1)
    # A second repo vanishing (deleted, or made private) is a typed error, not a crash.
    gone = Source("hf", "hf://org/gone@" + fake_sha("gone"), repo="org/gone",
                  revision=fake_sha("gone"))
    with pytest.raises(SourceNotFound, match="org/gone"):
        fetch_source(gone, storage, cache, tmp_path / "inputs" / "1")


def test_a_second_fetch_comes_from_the_cache_without_downloads(
        hub: FakeHub, repos: Repos, tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "storage")
    want = _checkpoint(repos, "org/base")
    total = sum(len(d) for d in want.values())
    first = fetch_source(_source(hub, "org/base"), storage,
                         InputCache(tmp_path / "cache", 10**9), tmp_path / "inputs" / "0")
    assert first[1:] == (total, 0)
    hub.clear()
    # Another job, another worker process: only the cache folder is shared.
    path, fetched, cached = fetch_source(_source(hub, "org/base"), storage,
                                         InputCache(tmp_path / "cache", 10**9),
                                         tmp_path / "inputs" / "1")
    assert (fetched, cached) == (0, total)
    _same_files(path, want)
    assert hub.downloads() == {}
    # Only the listing was asked for: no file of the repo was requested in any way.
    assert hub.log() and all(r.file is None and "/tree/" in r.path for r in hub.log())
    # Both job folders are names of the one cached copy.
    assert (path / "model.safetensors").samefile(first[0] / "model.safetensors")


def test_the_same_weights_in_two_repos_are_stored_once(
        hub: FakeHub, repos: Repos, tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "storage")
    cache = InputCache(tmp_path / "cache", 10**9)
    hub.add_repo("org/base-mirror", repos.folders["org/base"])  # other repo, other commit
    want = _checkpoint(repos, "org/base")
    total = sum(len(d) for d in want.values())
    assert fetch_source(_source(hub, "org/base"), storage, cache,
                        tmp_path / "inputs" / "0")[1:] == (total, 0)
    held = _cached(cache)
    hub.clear()
    path, fetched, cached = fetch_source(_source(hub, "org/base-mirror"), storage, cache,
                                         tmp_path / "inputs" / "1")
    assert (fetched, cached) == (0, total)
    _same_files(path, want)
    assert hub.downloads() == {}
    assert _cached(cache) == held  # nothing added: one copy of each file's bytes
    # Same file names, other weights: fetched, not confused with the cached ones by name.
    donor = _checkpoint(repos, "org/donor")
    assert _sha(donor["model.safetensors"]) not in held
    path, fetched, _ = fetch_source(_source(hub, "org/donor"), storage, cache,
                                    tmp_path / "inputs" / "2")
    _same_files(path, donor)
    assert hub.downloads("org/donor").get("model.safetensors") == 1
    assert fetched >= len(donor["model.safetensors"])
    assert _sha(donor["model.safetensors"]) in _cached(cache)


def _flip(data: bytes) -> bytes:
    """``data`` with one byte changed in the middle: same length, other content."""
    mid = len(data) // 2
    return data[:mid] + bytes([data[mid] ^ 0xFF]) + data[mid + 1:]


@pytest.mark.parametrize("fault", ["weights-wrong-sha256", "weights-truncated",
                                   "config-wrong-bytes", "connection-dropped"])
def test_a_corrupt_or_cut_download_fails_and_leaves_no_cache_entry(
        hub: FakeHub, repos: Repos, tmp_path: Path, fault: str) -> None:
    storage = LocalStorage(tmp_path / "storage")
    cache = InputCache(tmp_path / "cache", 10**9)
    want = _checkpoint(repos, "org/donor")
    if fault == "weights-wrong-sha256":
        bad = "model.safetensors"
        hub.tampered["org/donor", bad] = _flip(want[bad])
    elif fault == "weights-truncated":
        bad = "model.safetensors"
        hub.tampered["org/donor", bad] = want[bad][:-100]
    elif fault == "config-wrong-bytes":  # not an LFS file: checked against its git blob id
        bad = "config.json"
        hub.tampered["org/donor", bad] = want[bad].replace(b'"', b"'", 1)
        assert len(hub.tampered["org/donor", bad]) == len(want[bad])
    else:
        hub.drop_after = 1000  # every file is cut there: the first larger one fails
        bad = next(n for n in sorted(want) if len(want[n]) > hub.drop_after)
    with pytest.raises(StorageError) as caught:
        fetch_source(_source(hub, "org/donor"), storage, cache, tmp_path / "inputs" / "0")
    err = caught.value
    assert err.code == "storage_unavailable"
    assert err.details["source"] == hub.uri("org/donor") and err.details["file"] == bad
    assert hub.downloads("org/donor").get(bad) == 1  # it was downloaded, and refused
    if fault == "weights-truncated":  # the message says what was wrong with it
        assert f"sent {len(want[bad]) - 100} bytes" in err.message, err.message
    elif fault.endswith(("sha256", "bytes")):
        assert "do not match" in err.message, err.message
    # Whatever is cached is a good file of the repo; the refused one is not there at all.
    held = _cached(cache)
    assert set(held) <= {_sha(d) for d in want.values()}
    assert _sha(want[bad]) not in held
    # Once the hub serves the right bytes, the same cache fetches and keeps them.
    hub.tampered.clear()
    hub.drop_after = None
    path, fetched, cached = fetch_source(_source(hub, "org/donor"), storage, cache,
                                         tmp_path / "inputs" / "1")
    _same_files(path, want)
    assert fetched >= len(want[bad]) and fetched + cached == sum(len(d) for d in want.values())
    assert _sha(want[bad]) in _cached(cache)


def test_eviction_keeps_the_cache_under_its_cap(hub: FakeHub, repos: Repos,
                                                tmp_path: Path) -> None:
    storage = LocalStorage(tmp_path / "storage")
    files = {r: _checkpoint(repos, r) for r in ("org/base", "org/donor", "org/lang")}
    weights = {r: _sha(f["model.safetensors"]) for r, f in files.items()}
    # The repos differ only in their weights (one config, one tokenizer)...
    side = {n: d for n, d in files["org/base"].items() if n != "model.safetensors"}
    assert all({n: d for n, d in f.items() if n != "model.safetensors"} == side
               for f in files.values())
    # ... and the cap holds two of them (the side files once).
    cap = sum(len(d) for d in files["org/base"].values()) + len(
        files["org/donor"]["model.safetensors"])
    cache = InputCache(tmp_path / "cache", cap)

    def fetch(repo: str, n: int) -> tuple[int, int]:
        path, fetched, cached = fetch_source(_source(hub, repo), storage, cache,
                                             tmp_path / "inputs" / str(n))
        _same_files(path, files[repo])
        assert sum(p.stat().st_size for p in cache.objects.iterdir()) <= cap
        _age(cache)  # what comes next is clearly later (mtime is the last use)
        return fetched, cached

    fetch("org/base", 0)
    fetch("org/donor", 1)
    assert set(_cached(cache)) >= {weights["org/base"], weights["org/donor"]}  # both fit
    fetch("org/lang", 2)
    # The least recently used weights made room; the side files (just used) stayed.
    held = _cached(cache)
    assert weights["org/base"] not in held
    assert {weights["org/donor"], weights["org/lang"]} <= set(held)
    assert {_sha(d) for d in side.values()} <= set(held)
    hub.clear()
    fetched, cached = fetch("org/base", 3)
    # Only the evicted weights come again; the cached side files were not evicted to
    # make room for them (they are part of the same fetch).
    assert hub.downloads() == {"model.safetensors": 1}
    assert (fetched, cached) == (len(files["org/base"]["model.safetensors"]),
                                 sum(len(d) for d in side.values()))
    assert weights["org/donor"] not in _cached(cache)


def _runner(api: Api) -> JobRunner:
    return JobRunner(api.settings, api.worker_store(), LocalStorage(api.settings.storage_dir),
                     worker="test")


def _download(api: Api, job: dict[str, Any], dest: Path) -> Path:
    dest.mkdir(parents=True)
    for f in job["result"]["files"]:
        r = api.client.get(f["url"], headers=api.auth())
        assert r.status_code == 200, f["path"]
        assert hashlib.sha256(r.content).hexdigest() == f["sha256"]
        (dest / f["path"]).write_bytes(r.content)
    return dest


def test_job_with_hub_sources_succeeds_and_matches_local(
        api: Api, hub: FakeHub, repos: Repos, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    jid = str(api.submit(_body(hub))["id"])
    hub.clear()
    with caplog.at_level(logging.INFO, logger="maec.worker"):
        assert _runner(api).run(jid) == "succeeded"
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    assert job["status"] == "succeeded" and job["error"] is None, job
    # The worker fetched each repo's weights whole, once (and nothing it must not).
    repos_used = ("org/base", "org/donor", "org/lang")
    for repo in repos_used:
        assert hub.downloads(repo).get("model.safetensors") == 1
    assert not {r.file for r in hub.log()} & NEVER
    # The job's fetch report counts them (each distinct file once, the rest from cache).
    total = sum(len(d) for r in repos_used for d in _checkpoint(repos, r).values())
    distinct = {_sha(d): len(d) for r in repos_used for d in _checkpoint(repos, r).values()}
    assert (f"inputs ready ({sum(distinct.values())} bytes fetched, "
            f"{total - sum(distinct.values())} from cache)") in caplog.text
    # A second job with the same sources downloads no weights at all.
    again = str(api.submit(_body(hub))["id"])
    hub.clear()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="maec.worker"):
        assert _runner(api).run(again) == "succeeded"
    assert hub.downloads() == {}
    assert f"inputs ready (0 bytes fetched, {total} from cache)" in caplog.text
    # Same inputs as the local checkpoints the hub repos were copied from: same output.
    local = str(api.submit()["id"])
    assert _runner(api).run(local) == "succeeded"
    other = api.client.get(f"/v1/jobs/{local}", headers=api.auth()).json()
    # (recipe.yaml and README.md name the sources, so they differ; the weights must not.)
    digest = {f["path"]: f["sha256"] for f in job["result"]["manifest"]["files"]
              if f["path"] not in ("recipe.yaml", "README.md")}
    assert "model.safetensors" in digest
    assert digest.items() <= {(f["path"], f["sha256"])
                              for f in other["result"]["manifest"]["files"]}
    folder = _download(api, job, tmp_path / "out")
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9]])).logits
    assert logits.shape == (1, 3, 64) and torch.isfinite(logits).all()


def test_job_fails_with_source_not_found_when_a_repo_vanishes(api: Api,
                                                               hub: FakeHub) -> None:
    jid = str(api.submit(_body(hub))["id"])
    del hub.repos["org/donor"]  # deleted (or made private) after submission
    assert _runner(api).run(jid) == "failed"
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    assert job["error"]["code"] == "source_not_found", job["error"]
    assert "org/donor" in job["error"]["message"]


def test_job_fails_with_storage_unavailable_on_a_corrupt_download(
        api: Api, hub: FakeHub, repos: Repos) -> None:
    weights = _checkpoint(repos, "org/donor")["model.safetensors"]
    jid = str(api.submit(_body(hub))["id"])
    hub.tampered["org/donor", "model.safetensors"] = _flip(weights)
    assert _runner(api).run(jid) == "failed"
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    assert job["error"]["code"] == "storage_unavailable", job["error"]
    assert job["error"]["details"] == {"source": hub.uri("org/donor"),
                                       "file": "model.safetensors"}
    # The refused bytes were not kept: once the hub is right, a job gets the real weights.
    hub.tampered.clear()
    hub.clear()
    jid = str(api.submit(_body(hub))["id"])
    assert _runner(api).run(jid) == "succeeded"
    assert hub.downloads("org/donor").get("model.safetensors") == 1
