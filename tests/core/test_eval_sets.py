"""Eval specs, set files, answer extraction and report rendering: the torch-free part."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from maec_core.errors import EvalSetError, EvalSetUnreadable
from maec_core.eval import sets as sets_mod
from maec_core.eval.answers import extract_answer, is_correct, parse_number
from maec_core.eval.report import (
    AccuracyItem,
    EvalReport,
    ModelResult,
    SetResult,
    read_report,
    write_report,
)
from maec_core.eval.sets import load_set, load_sets, load_spec, parse_spec

ROOT = Path(__file__).resolve().parents[2]

# ------------------------------------------------------------------ answer extraction

# A hand-made output stream: what models write, and the number MGSM's rule reads.
OUTPUTS = [
    ("She has 3 apples and buys 4 more, so 7.", "7"),
    ("The total is 1,234 dollars.", "1234"),
    ("It costs $12,500.50 in all", "12500.5"),
    ("The temperature fell to -5 degrees", "-5"),
    ("x = -12.", "-12"),
    ("pages 10-12", "12"),
    ("3.50", "3.5"),
    ("The answer is 18.0", "18"),
    ("0.25 of the cake", "0.25"),
    ("The answer is 5. Question: what is 6", "6"),
    ("I do not know.", None),
    ("", None),
    ("1,000,000 grains", "1000000"),
    ("\u22127 below zero", "-7"),
    ("a list: 1, 2, 3", "3"),
    ("007 agents", "7"),
]


@pytest.mark.parametrize(("output", "expected"), OUTPUTS)
def test_extract_answer_takes_the_last_number(output: str, expected: str | None) -> None:
    assert extract_answer(output) == expected


def test_gold_answers_are_canonical_and_matched_exactly() -> None:
    assert parse_number("1,000") == "1000"
    assert parse_number(" 18 ") == "18"
    assert parse_number("2.50") == "2.5"
    assert parse_number("-3") == "-3"
    assert parse_number("-0.0") == "0"
    for bad in ("abc", "1 2", "", "3/4", "1e5", "--2"):
        assert parse_number(bad) is None, bad
    assert is_correct(extract_answer("so 1,000.00"), "1000")
    assert not is_correct(extract_answer("so 100"), "1000")
    assert not is_correct(None, "0")


# ----------------------------------------------------------------------------- specs


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_spec_parses_fills_defaults_and_resolves_paths(tmp_path: Path) -> None:
    _write(tmp_path / "qa.tsv", "w1 ?\t3\n")
    spec = load_spec(_write(tmp_path / "eval.yaml", """
sets:
  - {name: mgsm-sw, language: sw, kind: accuracy, path: qa.tsv,
     few_shot: {path: shots.jsonl, k: 2, language: target}}
  - {name: wiki-sw, language: sw, kind: perplexity, path: /data/wiki.txt, context: 512}
"""))
    acc, ppl = spec.sets
    assert acc.path == str(tmp_path / "qa.tsv") and acc.file_format == "tsv"
    assert acc.few_shot is not None and acc.few_shot.path == str(tmp_path / "shots.jsonl")
    assert acc.few_shot.language == "target" and acc.few_shot.file_format == "jsonl"
    assert acc.prompt_template == "Question: {question}\nAnswer:"
    assert acc.new_tokens == 256 and acc.stop_strings == ["\n\n"] and acc.batch_size == 8
    assert ppl.path == "/data/wiki.txt" and ppl.file_format == "text"
    assert ppl.context == 512 and ppl.stride is None
    # A bare list is a spec too.
    bare = parse_spec("- {name: a, language: en, kind: perplexity, path: a.jsonl}\n",
                      base_dir=tmp_path)
    assert bare.sets[0].file_format == "jsonl"


@pytest.mark.parametrize(("text", "line", "words"), [
    ("sets:\n  - name: a\n    language: en\n    kind: perplexity\n    path: a.txt\n"
     "  - name: b\n    language: en\n    kind: perplexed\n    path: b.txt\n",
     8, "sets.1.kind"),
    ("sets:\n  - {name: a, language: en, kind: perplexity, path: a.txt}\n"
     "  - {name: b, language: en, kind: accuracy, path: b.tsv, contex: 4}\n",
     3, "contex"),
    ("- {name: a, language: en, kind: accuracy, path: b.tsv, context: 4}\n", 1,
     "sets.0: context: only for kind perplexity"),
    ("- {name: a, language: en, kind: accuracy, path: b.txt}\n", 1, "JSONL or TSV"),
    ("- {name: a, language: en, kind: perplexity, path: b.tsv}\n", 1, "JSONL or plain"),
    ("- {name: a, language: en, kind: accuracy, path: b.tsv, template: 'Q:'}\n", 1,
     "{question}"),
    ("- {name: a, language: en, kind: perplexity, path: a.txt, context: 8, stride: 9}\n",
     1, "stride 9 is larger than context 8"),
    ("- {name: a, language: en, kind: perplexity, path: a.txt}\n"
     "- {name: a, language: en, kind: perplexity, path: b.txt}\n", 1, "two eval sets"),
    ("- {name: 'a b', language: en, kind: perplexity, path: a.txt}\n", 1, "name"),
    ("- {name: a, language: english!, kind: perplexity, path: a.txt}\n", 1, "language"),
    ("- {name: a, language: en, kind: accuracy, path: b.tsv,\n"
     "   few_shot: {path: s.tsv, k: 99, language: target}}\n", 2, "few_shot.k"),
    ("- {name: a, language: en, kind: accuracy, path: b.tsv,\n"
     "   few_shot: {path: s.tsv, k: 2, language: fr}}\n", 2, "few_shot.language"),
    ("- {name: a, language: en, kind: accuracy, path: b.tsv, batch_size: 0}\n", 1,
     "batch_size"),
    ("sets: []\n", 1, "sets"),
    ("sets:\n  - name: a\n    language: en: fr\n", 3, "not valid YAML"),
    ("- {name: a, language: en, kind: accuracy, path: b.tsv, stop: ['']}\n", 1, "stop"),
])
def test_malformed_specs_name_their_line(text: str, line: int, words: str) -> None:
    with pytest.raises(EvalSetError) as info:
        parse_spec(text, source="eval.yaml")
    err = info.value
    assert err.code == "invalid_eval_set"
    assert f"eval.yaml line {line}" in err.message, err.message
    assert words in err.message, err.message
    assert err.details["line"] == line


def test_spec_caps(tmp_path: Path) -> None:
    sets = "".join(f"- {{name: s{i}, language: en, kind: perplexity, path: a.txt}}\n"
                   for i in range(sets_mod.MAX_SETS + 1))
    with pytest.raises(EvalSetError, match="sets"):
        parse_spec(sets)
    with pytest.raises(EvalSetError, match="larger than"):
        parse_spec("#" * (sets_mod.SPEC_MAX_BYTES + 1))
    long_template = "{question}" + "x" * sets_mod.MAX_TEMPLATE_CHARS
    with pytest.raises(EvalSetError, match="template"):
        parse_spec(f"- {{name: a, language: en, kind: accuracy, path: b.tsv, "
                   f"template: '{long_template}'}}\n")
    with pytest.raises(EvalSetUnreadable) as info:
        load_spec(tmp_path / "missing.yaml")
    assert info.value.code == "eval_set_unreadable"


def test_root_confines_set_paths(tmp_path: Path) -> None:
    root = tmp_path / "sets"
    root.mkdir()
    ok = parse_spec("- {name: a, language: en, kind: perplexity, path: a.txt}\n",
                    base_dir=root, root=root)
    assert ok.sets[0].path == str(root / "a.txt")
    for path in ("../a.txt", "/etc/passwd"):
        with pytest.raises(EvalSetError, match="outside the allowed folder"):
            parse_spec(f"- {{name: a, language: en, kind: perplexity, path: '{path}'}}\n",
                       base_dir=root, root=root)
    (root / "link.txt").symlink_to(tmp_path / "elsewhere.txt")
    with pytest.raises(EvalSetError, match="outside"):
        parse_spec("- {name: a, language: en, kind: perplexity, path: link.txt}\n",
                   base_dir=root, root=root)
    with pytest.raises(EvalSetError, match="outside"):
        parse_spec("- {name: a, language: en, kind: accuracy, path: a.tsv,\n"
                   "   few_shot: {path: ../s.tsv, k: 1, language: source}}\n",
                   base_dir=root, root=root)


# ------------------------------------------------------------------------- set files


def _set(tmp_path: Path, kind: str, name: str, body: str | bytes, **extra: object):
    path = tmp_path / name
    if isinstance(body, bytes):
        path.write_bytes(body)
    else:
        path.write_text(body)
    fields = ", ".join(f"{k}: {json.dumps(v)}" for k, v in extra.items())
    spec = parse_spec(f"- {{name: s, language: en, kind: {kind}, path: {name}"
                      f"{', ' + fields if fields else ''}}}\n", base_dir=tmp_path)
    return spec.sets[0]


def test_text_sets_jsonl_and_paragraphs(tmp_path: Path) -> None:
    s = load_set(_set(tmp_path, "perplexity", "t.jsonl",
                      '{"text": "one two"}\n\n{"text": "   "}\n{"text": "three", "id": 4}\n'))
    assert s.texts == ("one two", "three")
    s = load_set(_set(tmp_path, "perplexity", "t.txt",
                      "para one\r\nline two\n\n\n  \npara two\n"))
    assert s.texts == ("para one\nline two", "para two")
    s = load_set(_set(tmp_path, "perplexity", "t2.txt", "a\n\nb\n\nc\n", max_items=2))
    assert s.texts == ("a", "b")


def test_qa_sets_jsonl_and_mgsm_tsv(tmp_path: Path) -> None:
    s = load_set(_set(tmp_path, "accuracy", "q.jsonl",
                      '{"question": "How many?", "answer": 1000}\n'
                      '{"question": "And now?", "answer": "1,250.50", "extra": 1}\n'))
    assert [(i.question, i.answer) for i in s.items] == [("How many?", "1000"),
                                                         ("And now?", "1250.5")]
    # MGSM: question<TAB>answer, the question may hold tabs (split at the last one).
    s = load_set(_set(tmp_path, "accuracy", "q.tsv", "Janet\thas 16 eggs.\t18\nQ2\t-3\n"))
    assert [(i.question, i.answer) for i in s.items] == [("Janet\thas 16 eggs.", "18"),
                                                         ("Q2", "-3")]


@pytest.mark.parametrize(("name", "body", "line", "words"), [
    ("q.jsonl", '{"question": "a", "answer": 1}\n\n{"question": "b", "answer": 2\n', 3,
     "not JSON"),
    ("q.jsonl", '{"question": "a", "answer": 1}\n["a", 1]\n', 2, "JSON object"),
    ("q.jsonl", '{"question": "a", "answer": 1}\n{"q": "b", "answer": 2}\n', 2, "question"),
    ("q.jsonl", '{"question": "a", "answer": true}\n', 1, "answer"),
    ("q.jsonl", '{"question": "a", "answer": "twelve"}\n', 1, "'twelve' is not a number"),
    ("q.jsonl", '{"question": " ", "answer": 1}\n', 1, "empty question"),
    ("q.tsv", "a\t1\nno tab here\n", 2, "question<TAB>answer"),
    ("q.tsv", "a\t1\nb\t1 or 2\n", 2, "is not a number"),
    ("q.tsv", "a\t1\n" + "x" * (sets_mod.MAX_QUESTION_CHARS + 1) + "\t2\n", 2, "longer"),
])
def test_malformed_set_lines_are_refused_with_their_number(
        tmp_path: Path, name: str, body: str, line: int, words: str) -> None:
    with pytest.raises(EvalSetError) as info:
        load_set(_set(tmp_path, "accuracy", name, body))
    err = info.value
    assert type(err) is EvalSetError and err.code == "invalid_eval_set"
    assert f"{name} line {line}: " in err.message and words in err.message, err.message
    assert err.details == {"file": name, "line": line}


def test_malformed_text_lines_are_refused(tmp_path: Path) -> None:
    with pytest.raises(EvalSetError, match=r"t.jsonl line 2: expected \{\"text\""):
        load_set(_set(tmp_path, "perplexity", "t.jsonl", '{"text": "a"}\n{"text": 3}\n'))
    # A line separator inside a JSON string is not a line break.
    s = load_set(_set(tmp_path, "perplexity", "u.jsonl", '{"text": "a\u2028b"}\n'))
    assert s.texts == ("a\u2028b",)


def test_unreadable_and_empty_sets(tmp_path: Path) -> None:
    missing = _set(tmp_path, "perplexity", "m.txt", "x").model_copy(
        update={"path": str(tmp_path / "nope.txt")})
    with pytest.raises(EvalSetUnreadable) as info:
        load_set(missing)
    assert info.value.code == "eval_set_unreadable"
    with pytest.raises(EvalSetUnreadable, match=r"b\.txt line 2 is not UTF-8"):
        load_set(_set(tmp_path, "perplexity", "b.txt", b"fine\n\xff\xfe bad\n"))
    with pytest.raises(EvalSetError, match="has no text"):
        load_set(_set(tmp_path, "perplexity", "e.txt", "\n \n"))
    with pytest.raises(EvalSetError, match="has no items"):
        load_set(_set(tmp_path, "accuracy", "e.tsv", ""))


def test_item_and_size_caps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sets_mod, "MAX_ITEMS", 3)
    body = "".join(f"q{i}\t{i}\n" for i in range(5))
    with pytest.raises(EvalSetError, match="more than 3 items; set max_items"):
        load_set(_set(tmp_path, "accuracy", "q.tsv", body))
    assert len(load_set(_set(tmp_path, "accuracy", "q2.tsv", body, max_items=2)).items) == 2
    monkeypatch.setattr(sets_mod, "SET_MAX_BYTES", 10)
    with pytest.raises(EvalSetError, match="above the 10 byte cap"):
        load_set(_set(tmp_path, "accuracy", "q3.tsv", body))


def test_few_shot_exemplars(tmp_path: Path) -> None:
    _write(tmp_path / "shots.jsonl",
           '{"question": "2 + 2?", "answer": "2 and 2 make 4. The answer is 4."}\n'
           '{"question": "3 + 1?", "answer": 4}\n{"question": "x", "answer": "y"}\n')
    _write(tmp_path / "q.tsv", "1 + 1?\t2\n")
    spec = parse_spec("- {name: s, language: sw, kind: accuracy, path: q.tsv,\n"
                      "   template: 'Q: {question}\n\n    A:',\n"
                      "   few_shot: {path: shots.jsonl, k: 2, language: source}}\n",
                      base_dir=tmp_path)
    (s,) = load_sets(spec)
    assert [e.answer for e in s.exemplars] == ["2 and 2 make 4. The answer is 4.", "4"]
    assert s.prompt("1 + 1?") == ("Q: 2 + 2?\nA: 2 and 2 make 4. The answer is 4.\n\n"
                                  "Q: 3 + 1?\nA: 4\n\nQ: 1 + 1?\nA:")
    # Braces in questions are text, not format fields.
    assert s.prompt("{x}?").endswith("Q: {x}?\nA:")
    shot = spec.sets[0].few_shot
    assert shot is not None
    too_many = spec.sets[0].model_copy(update={"few_shot": shot.model_copy(update={"k": 4})})
    with pytest.raises(EvalSetError, match="3 exemplars, fewer than k=4"):
        load_set(too_many)


# ---------------------------------------------------------------------------- report


def _report() -> EvalReport:
    item = AccuracyItem(index=0, question="q", answer="3", prompt="Q: q", output="3",
                        extracted="3", correct=True, output_tokens=2)
    acc = SetResult(name="mgsm-sw", language="sw", kind="accuracy", value=0.5, count=2,
                    correct=1, seconds=1.0, items=[item, item.model_copy(
                        update={"index": 1, "correct": False})])
    ppl = SetResult(name="wiki|sw", language="sw", kind="perplexity", value=12.3456,
                    count=100, mean_nll=2.5, seconds=1.0)
    return EvalReport(models=[
        ModelResult(label="merged", model_dir="/m", device="cpu", dtype="float32",
                    seconds=2.0, sets=[acc, ppl]),
        ModelResult(label="base", model_dir="/b", device="cpu", dtype="float32",
                    seconds=1.0, sets=[ppl.model_copy(update={"value": 20.0})]),
    ])


def test_report_table_text_markdown_and_json(tmp_path: Path) -> None:
    report = _report()
    assert report.text_table() == (
        "model   mgsm-sw [sw]     wiki|sw [sw]\n"
        "------  ---------------  ------------\n"
        "merged  acc 0.500 (1/2)  ppl 12.35\n"
        "base    -                ppl 20\n")
    assert report.markdown_table() == (
        "| model | mgsm-sw [sw] | wiki\\|sw [sw] |\n"
        "| --- | --- | --- |\n"
        "| merged | acc 0.500 (1/2) | ppl 12.35 |\n"
        "| base | - | ppl 20 |\n")
    assert report.table == {
        "columns": [{"name": "mgsm-sw", "language": "sw", "kind": "accuracy",
                     "metric": "accuracy"},
                    {"name": "wiki|sw", "language": "sw", "kind": "perplexity",
                     "metric": "perplexity"}],
        "rows": [{"model": "merged", "cells": {"mgsm-sw": 0.5, "wiki|sw": 12.3456}},
                 {"model": "base", "cells": {"mgsm-sw": None, "wiki|sw": 20.0}}],
    }
    out = write_report(report, tmp_path / "eval_report.json")
    doc = json.loads(out.read_text())
    assert doc["table"] == report.table and doc["version"] == 1
    assert len(doc["models"][0]["sets"][0]["items"]) == 2
    assert read_report(out) == report
    assert not list(tmp_path.glob("*.partial"))


def test_api_side_modules_import_no_torch() -> None:
    code = ("import sys, maec_core.eval, maec_core.eval.sets, maec_core.eval.answers, "
            "maec_core.eval.report, maec_core.eval.cli\n"
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
