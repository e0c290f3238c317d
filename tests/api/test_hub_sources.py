"""Hub sources (``hf://owner/name@<sha>``) against a fake Hub on 127.0.0.1.

The repos are the session's tiny Llama checkpoints, served by ``tests/fakehub.py`` with
the requests ``huggingface_hub`` really makes; the donor repo also holds what must never
be fetched: a pickle whose unpickling leaves a marker, a ``random.py`` that would too, a
stray JSON file and a sub-folder with more weights. Submission goes through the real app
(TestClient, real Redis); jobs run in-process with ``JobRunner``.
"""

from __future__ import annotations

import hashlib
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


def test_worker_fetch_is_exact_and_byte_identical(api: Api, hub: FakeHub,
                                                  repos: Repos, tmp_path: Path) -> None:
    repo = hub.repos["org/donor"]
    source = Source("hf", hub.uri("org/donor"), repo="org/donor", revision=repo.sha)
    storage = LocalStorage(tmp_path / "storage")
    dest = tmp_path / "inputs" / "0"
    path, _, _ = fetch_source(source, storage, InputCache(tmp_path / "cache", 10**9), dest)
    got = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()
           and ".cache" not in p.relative_to(path).parts}
    want = {n for n in CHECKPOINT if (repos.folders["org/donor"] / n).is_file()}
    assert got == want, got
    for name in got:
        assert (path / name).read_bytes() == (repos.folders["org/donor"] / name).read_bytes()
    ours = load_file(str(path / "model.safetensors"))
    theirs = load_file(str(repos.folders["org/donor"] / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == theirs[k].dtype and ours[k].equal(theirs[k]) for k in ours)
    log = hub.log()
    assert hub.files_fetched("org/donor") == want
    assert not {r.file for r in log} & NEVER
    assert all(repo.sha in r.path for r in log if r.origin == "hub")
    # A second repo vanishing (deleted, or made private) is a typed error, not a crash.
    gone = Source("hf", "hf://org/gone@" + fake_sha("gone"), repo="org/gone",
                  revision=fake_sha("gone"))
    with pytest.raises(SourceNotFound, match="org/gone"):
        fetch_source(gone, storage, InputCache(tmp_path / "cache", 10**9),
                     tmp_path / "inputs" / "1")


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


def test_job_with_hub_sources_succeeds_and_matches_local(api: Api, hub: FakeHub,
                                                         tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    jid = str(api.submit(_body(hub))["id"])
    hub.clear()
    assert _runner(api).run(jid) == "succeeded"
    job = api.client.get(f"/v1/jobs/{jid}", headers=api.auth()).json()
    assert job["status"] == "succeeded" and job["error"] is None, job
    # The worker fetched each repo's weights whole (and nothing it must not).
    for repo in ("org/base", "org/donor", "org/lang"):
        assert "model.safetensors" in hub.files_fetched(repo)
    assert not {r.file for r in hub.log()} & NEVER
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
