from __future__ import annotations

import hashlib
import json
import os
import re

import pytest

from maec_client import (
    ChecksumMismatch,
    DownloadError,
    JobNotSucceeded,
    NetworkError,
    NotFound,
)
from maec_client.download import MARKER


def payload(n: int, seed: int = 0) -> bytes:
    # Non-repeating bytes, so a range written at the wrong offset cannot hash right.
    out = bytearray()
    block = seed.to_bytes(4, "big")
    while len(out) < n:
        block = hashlib.sha256(block).digest()
        out += block
    return bytes(out[:n])


FILES = {
    "model-00001-of-00002.safetensors": payload(100_000, 1),
    "model-00002-of-00002.safetensors": payload(40_000, 2),
    "config.json": b'{"model_type": "llama"}',
    "manifest.json": b'{"format_version": 1}',
    "sub/empty.txt": b"",
}


def ranges(fake, path: str) -> list[str]:
    return [r.headers.get("range", "") for r in fake.file_requests() if r.url.path.endswith(path)]


def tree(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


@pytest.fixture
def job(fake):
    j = fake.add_job()
    return fake.finish(j["id"], FILES)


def test_download_splits_large_files_and_verifies(client, fake, job, tmp_path):
    dest = tmp_path / "out"
    seen = []
    got = client.download(job["id"], dest, part_size=30_000, workers=4,
                          on_bytes=lambda done, total: seen.append((done, total)))
    assert got == dest and tree(dest) == FILES
    assert not (tmp_path / "out.partial").exists()
    big = ranges(fake, "model-00001-of-00002.safetensors")
    assert sorted(big) == sorted(["bytes=0-29999", "bytes=30000-59999", "bytes=60000-89999",
                                  "bytes=90000-99999"])
    assert ranges(fake, "config.json") == ["bytes=0-22"]
    assert ranges(fake, "empty.txt") == []  # zero bytes: nothing to fetch
    total = sum(map(len, FILES.values()))
    assert seen[-1] == (total, total) and fake.bytes_served == total


def test_stream_cut_once_is_resumed_within_the_call(client, fake, job, tmp_path):
    fake.cut_next = [12_345]
    dest = tmp_path / "out"
    client.download(job["id"], dest, part_size=10**9, workers=1)
    assert tree(dest) == FILES
    first = [r for r in ranges(fake, "00001-of-00002.safetensors")]
    assert first == ["bytes=0-99999", "bytes=12345-99999"]


def test_interrupted_download_resumes_on_next_call(client, fake, job, tmp_path):
    # Cut after 12345 bytes, then a retry that gets nothing: retries=0 allows no attempt
    # without progress, so the call gives up and leaves the bytes for the next one.
    fake.cut_next = [12_345, 0]
    dest = tmp_path / "out"
    partial = tmp_path / "out.partial"
    with pytest.raises(NetworkError, match="resume"):
        client.download(job["id"], dest, part_size=10**9, workers=1, retries=0)
    assert not dest.exists()
    part = partial / "model-00001-of-00002.safetensors.part"
    assert part.read_bytes() == FILES["model-00001-of-00002.safetensors"][:12_345]

    fake.requests.clear()
    fake.bytes_served = 0
    client.download(job["id"], dest, workers=1)
    assert tree(dest) == FILES and not partial.exists()
    assert ranges(fake, "model-00001-of-00002.safetensors") == ["bytes=12345-99999"]
    # Only what was missing travelled again (the workers=1 pool stopped after the cut).
    assert fake.bytes_served == sum(map(len, FILES.values())) - 12_345


def test_ranged_parts_resume_with_their_own_offsets(client, fake, job, tmp_path):
    dest = tmp_path / "out"
    partial = tmp_path / "out.partial"
    fake.cut_next = [5_000, 0]
    with pytest.raises(NetworkError):
        client.download(job["id"], dest, part_size=30_000, workers=1, retries=0)
    fake.requests.clear()
    client.download(job["id"], dest, part_size=30_000, workers=2)
    assert tree(dest) == FILES and not partial.exists()
    # Which range was cut depends on scheduling order; whichever it was resumes at +5000.
    big = ranges(fake, "model-00001-of-00002.safetensors")
    starts = {int(re.match(r"bytes=(\d+)-", h).group(1)) for h in big}
    assert starts & {5_000, 35_000, 65_000, 95_000}


def test_ranges_are_written_in_place_with_a_ledger(client, fake, job, tmp_path):
    dest = tmp_path / "out"
    partial = tmp_path / "out.partial"
    name = "model-00001-of-00002.safetensors"
    fake.cut_next = [5_000, 0]  # first range: 5000 bytes, then a fruitless retry
    with pytest.raises(NetworkError):
        client.download(job["id"], dest, part_size=30_000, workers=1, retries=0)
    ledger = json.loads((partial / (name + ".part.json")).read_text())
    assert ledger["ranges"] == [[0, 29999], [30000, 59999], [60000, 89999], [90000, 99999]]
    assert ledger["done"] == {"0": 5000, "30000": 0, "60000": 0, "90000": 0}
    assert (partial / (name + ".part")).read_bytes()[:5000] == FILES[name][:5000]
    fake.requests.clear()
    client.download(job["id"], dest, part_size=30_000, workers=2)
    assert tree(dest) == FILES
    assert sorted(ranges(fake, name)) == ["bytes=30000-59999", "bytes=5000-29999",
                                          "bytes=60000-89999", "bytes=90000-99999"]


def test_single_stream_prefix_is_credited_to_ranges(client, fake, job, tmp_path):
    dest = tmp_path / "out"
    name = "model-00001-of-00002.safetensors"
    fake.cut_next = [45_000, 0]
    with pytest.raises(NetworkError):
        client.download(job["id"], dest, part_size=10**9, workers=1, retries=0)
    fake.requests.clear()
    client.download(job["id"], dest, part_size=30_000, workers=3)
    assert tree(dest) == FILES
    assert sorted(ranges(fake, name)) == ["bytes=45000-59999", "bytes=60000-89999",
                                          "bytes=90000-99999"]


def test_in_place_file_with_holes_is_not_appended_to(client, fake, job, tmp_path):
    dest = tmp_path / "out"
    partial = tmp_path / "out.partial"
    name = "model-00001-of-00002.safetensors"
    fake.cut_next = [5_000, 0]
    with pytest.raises(NetworkError):
        client.download(job["id"], dest, part_size=30_000, workers=1, retries=0)
    fake.requests.clear()
    client.download(job["id"], dest, part_size=10**9, workers=3)
    assert tree(dest) == FILES
    assert ranges(fake, name) == ["bytes=0-99999"]
    assert not partial.exists()


def test_corrupted_byte_is_detected_and_nothing_published(client, fake, job, tmp_path):
    name = "model-00002-of-00002.safetensors"
    fake.corrupt.add((job["id"], name, 31_337))
    dest = tmp_path / "out"
    with pytest.raises(ChecksumMismatch) as info:
        client.download(job["id"], dest, part_size=16_000, workers=3)
    exc = info.value
    assert exc.path == name and exc.code == "checksum_mismatch"
    assert exc.expected == hashlib.sha256(FILES[name]).hexdigest() != exc.actual
    assert not dest.exists()
    partial = tmp_path / "out.partial"
    # The bad file is gone (so a rerun refetches it); nothing half-verified is trusted.
    assert not list(partial.glob(name + "*"))

    fake.corrupt.clear()
    client.download(job["id"], dest)
    assert tree(dest) == FILES


def test_server_ignoring_range_still_yields_the_right_bytes(client, fake, job, tmp_path):
    fake.ignore_range = True
    fake.cut_next = [7_000]
    dest = tmp_path / "out"
    client.download(job["id"], dest, part_size=25_000, workers=2)
    assert tree(dest) == FILES


def test_existing_destination_and_overwrite(client, fake, job, tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with pytest.raises(DownloadError, match="exists"):
        client.download(job["id"], dest)
    assert fake.file_requests() == []
    client.download(job["id"], dest, overwrite=True)
    assert tree(dest) == FILES
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_partial_of_another_job_is_not_mixed_in(client, fake, job, tmp_path):
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / MARKER).write_text('{"job_id": "j_other"}')
    (partial / "config.json").write_bytes(b"x" * len(FILES["config.json"]))
    with pytest.raises(DownloadError, match="j_other"):
        client.download(job["id"], tmp_path / "out")
    client.download(job["id"], tmp_path / "out", overwrite=True)
    assert tree(tmp_path / "out") == FILES


def test_complete_files_from_earlier_run_are_rehashed_not_trusted(client, fake, job,
                                                                   tmp_path):
    partial = tmp_path / "out.partial"
    partial.mkdir()
    (partial / MARKER).write_text(f'{{"job_id": "{job["id"]}"}}')
    (partial / "config.json").write_bytes(b"y" * len(FILES["config.json"]))  # damaged
    good = "model-00002-of-00002.safetensors"
    (partial / good).write_bytes(FILES[good])  # complete and right
    client.download(job["id"], tmp_path / "out")
    assert tree(tmp_path / "out") == FILES
    assert ranges(fake, "config.json") == ["bytes=0-22"]  # refetched
    assert ranges(fake, good) == []  # kept


def test_job_without_result_or_inconsistent_manifest_is_refused(client, fake, tmp_path):
    queued = fake.add_job()
    with pytest.raises(JobNotSucceeded):
        client.download(queued["id"], tmp_path / "a")
    j = fake.add_job()
    fake.finish(j["id"], {"a.bin": b"abc"},
                manifest_override={"files": [{"path": "a.bin", "size": 3, "sha256": "0" * 64}]})
    with pytest.raises(ChecksumMismatch):
        client.download(j["id"], tmp_path / "b")
    k = fake.add_job()
    fake.finish(k["id"], {"a.bin": b"abc"},
                manifest_override={"files": [{"path": "missing.bin", "size": 1,
                                              "sha256": "0" * 64}]})
    with pytest.raises(DownloadError, match=r"missing\.bin"):
        client.download(k["id"], tmp_path / "c")
    assert fake.file_requests() == []


@pytest.mark.parametrize("bad", ["../escape", "/etc/passwd", "a/../../b", "a\\b", "x.part"])
def test_unsafe_paths_from_the_service_are_refused(client, fake, tmp_path, bad):
    j = fake.add_job()
    fake.finish(j["id"], {bad: b"abc"}, manifest_override={})
    with pytest.raises(DownloadError):
        client.download(j["id"], tmp_path / "out")
    assert os.listdir(tmp_path) in ([], ["out.partial"])
    assert not (tmp_path / "out").exists()


def test_missing_file_on_server_is_not_found(client, fake, job, tmp_path):
    del fake.files[(job["id"], "config.json")]
    with pytest.raises(NotFound) as info:
        client.download(job["id"], tmp_path / "out")
    assert info.value.code == "file_not_found"
    assert not (tmp_path / "out").exists()


def test_absolute_file_urls_on_other_hosts_get_no_api_key(client, fake, tmp_path):
    j = fake.add_job()
    fake.finish(j["id"], {"a.bin": b"hello"}, absolute="http://127.0.0.1:8000")
    k = fake.add_job()
    fake.finish(k["id"], {"b.bin": b"world"}, absolute="http://127.0.0.2:9000")
    client.download(j["id"], tmp_path / "a")
    assert fake.file_requests()[-1].headers["authorization"] == "Bearer k1"
    # The fake answers 401 without a key: the foreign host was not handed ours.
    with pytest.raises(Exception, match="unauthorized"):
        client.download(k["id"], tmp_path / "b")
    assert "authorization" not in fake.file_requests()[-1].headers


def test_redirect_to_presigned_store_without_api_key(client, fake, job, tmp_path):
    client.download(job["id"], tmp_path / "out", redirect=True, part_size=30_000)
    assert tree(tmp_path / "out") == FILES
    store = [r for r in fake.requests if r.url.host == "127.0.0.3"]
    api = [r for r in fake.file_requests() if r.url.host == "127.0.0.1"]
    assert len(store) == len(api) == 8  # 4 + 2 ranges, 2 small files; each redirected once
    assert all("authorization" not in r.headers for r in store)
    assert all(r.headers["range"] for r in store)  # the Range survived the redirect


def test_etag_naming_other_bytes_stops_before_download(client, fake, job, tmp_path):
    name = "config.json"
    fake.files[(job["id"], name)] = b"X" * len(FILES[name])  # served bytes changed
    with pytest.raises(ChecksumMismatch) as info:
        client.download(job["id"], tmp_path / "out", workers=1)
    assert info.value.path == name and info.value.actual.startswith("ETag")
    assert not (tmp_path / "out").exists()


def test_second_concurrent_download_into_the_same_dir_is_refused(client, fake, job, tmp_path):
    import fcntl

    partial = tmp_path / "out.partial"
    partial.mkdir()
    fd = os.open(partial, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # as a running download holds it
        with pytest.raises(DownloadError, match="another download"):
            client.download(job["id"], tmp_path / "out")
    finally:
        os.close(fd)
    client.download(job["id"], tmp_path / "out")
    assert tree(tmp_path / "out") == FILES
