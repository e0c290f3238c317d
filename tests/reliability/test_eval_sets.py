"""Hostile eval sets and sweeps over HTTP: each refused before queueing with its stable
code (a bad line with its number), nothing read outside the allowed roots, and the
service keeps serving."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.reliability import results
from tests.stack import Stack, stack_context

pytestmark = [pytest.mark.faults, pytest.mark.integration]

ENV = {"MAEC_RATE_LIMIT_PER_MINUTE": "100000", "MAEC_RATE_LIMIT_BURST": "10000",
       "MAEC_SUBMISSIONS_PER_MINUTE": "100000"}


@pytest.fixture(scope="module")
def st(tmp_path_factory: pytest.TempPathFactory, model_root: Path) -> Iterator[Stack]:
    with stack_context(tmp_path_factory.mktemp("evalsets"), None, workers=1,
                       local_roots=[model_root], env=ENV) as stack:
        yield stack


def _write(root: Path, name: str, data: bytes) -> str:
    path = root / "evalsets" / name
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return str(path)


def _outside_link(root: Path, tmp: Path) -> str:
    secret = tmp / "secret.txt"
    secret.write_text("w1 w2 w3\n")
    link = root / "evalsets" / "link.txt"
    link.parent.mkdir(exist_ok=True)
    if link.is_symlink():
        link.unlink()
    os.symlink(secret, link)
    return str(link)


PPL = {"name": "s", "language": "sw", "kind": "perplexity"}
# (name, eval set entry built from (model_root, tmp_path), expected code, bad line)
CASES: list[tuple[str, Callable[[Path, Path], dict[str, Any]], str, int | None]] = [
    ("bad_json_line", lambda r, t: {**PPL, "path": _write(
        r, "a.jsonl", b'{"text": "w1"}\n{"text": "w2"\n')}, "invalid_eval_set", 2),
    ("not_a_string", lambda r, t: {**PPL, "path": _write(
        r, "b.jsonl", b'{"text": "w1"}\n\n{"text": ["w2"]}\n')}, "invalid_eval_set", 3),
    ("gold_not_a_number", lambda r, t: {**PPL, "kind": "accuracy", "path": _write(
        r, "c.jsonl", b'{"question": "q", "answer": "seven"}\n')}, "invalid_eval_set", 1),
    ("not_utf8", lambda r, t: {**PPL, "path": _write(r, "d.txt", b"w1\n\xc3\x28\n")},
     "eval_set_unreadable", 2),
    ("empty", lambda r, t: {**PPL, "path": _write(r, "e.txt", b"\n\n")},
     "invalid_eval_set", None),
    ("missing", lambda r, t: {**PPL, "path": str(r / "evalsets" / "none.txt")},
     "eval_set_unreadable", None),
    ("outside_root", lambda r, t: {**PPL, "path": "/etc/hostname"}, "invalid_source", None),
    ("dotdot", lambda r, t: {**PPL, "path": str(r / ".." / "x.txt")}, "invalid_source",
     None),
    ("symlink_escape", lambda r, t: {**PPL, "path": _outside_link(r, t)},
     "invalid_source", None),
    ("unknown_scheme", lambda r, t: {**PPL, "path": "http://example.com/x.txt"},
     "invalid_source", None),
    ("unknown_key", lambda r, t: {**PPL, "path": "/x.txt", "colour": 1},
     "invalid_eval_set", None),
    ("few_shot_outside", lambda r, t: {
        **PPL, "kind": "accuracy", "path": _write(
            r, "f.jsonl", b'{"question": "q", "answer": "1"}\n'),
        "few_shot": {"path": "/etc/passwd", "k": 1, "language": "target",
                     "format": "jsonl"}}, "invalid_source", None),
]


@pytest.mark.parametrize(("name", "entry", "code", "line"), CASES,
                         ids=[c[0] for c in CASES])
def test_hostile_eval_set_over_http(name: str, entry: Callable[[Path, Path], dict[str, Any]],
                                    code: str, line: int | None, st: Stack,
                                    tiny: dict[str, Path], model_root: Path,
                                    tmp_path: Path) -> None:
    body = {"method": "linear", "ability_donor": [str(tiny["a"])],
            "language_base": str(tiny["b"]), "evaluate": [entry(model_root, tmp_path)]}
    with st.client() as c:
        r = c.post("/v1/jobs", json=body)
        assert r.status_code == 422, r.text
        doc = r.json()
        assert doc["code"] == code, doc
        if line is not None:
            assert doc["details"]["line"] == line and f"line {line}" in doc["message"]
        assert "w1 w2 w3" not in json.dumps(doc)  # nothing of an outside file leaks
        assert c.get("/v1/jobs", params={"limit": 1}).json()["jobs"] == []
        assert c.get("/healthz").status_code == 200
    results.add("hostile_eval_sets")


@pytest.mark.parametrize("sweep", [
    {"grid": {"weight": [0.5] * 2}},  # a value twice
    {"grid": {"weight": [float(i) for i in range(33)]}},  # too many values
    {"grid": {f"k{i}": [1.0] for i in range(9)}},  # too many knobs
    {"grid": {"__class__": [1.0]}},
    {"grid": {"models[99].weight": [1.0]}},
    {"grid": {"weight": ["INF"]}},  # sent as the JSON number 1e999 (infinity)
])
def test_hostile_sweep_over_http(sweep: dict[str, Any], st: Stack, tiny: dict[str, Path],
                                 model_root: Path) -> None:
    path = _write(model_root, "ok.txt", b"w1 w2 w3 w4\n")
    body = {"method": "linear", "ability_donor": [str(tiny["a"])],
            "language_base": str(tiny["b"]), "evaluate": [{**PPL, "path": path}],
            "sweep": {**sweep, "objective": {"set": "s", "metric": "perplexity"}}}
    raw = json.dumps(body).replace('"INF"', "1e999")
    with st.client() as c:
        r = c.post("/v1/jobs", content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["code"] in ("invalid_sweep", "invalid_request"), r.json()
    results.add("hostile_eval_sets")
