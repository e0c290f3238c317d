"""Evaluation against known answers: a tiny model that memorised its eval sets, and a
random tiny model whose perplexity is recomputed directly with transformers."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from maec_core.context import RunContext
from maec_core.errors import Cancelled, EvalSetError
from maec_core.eval.measure import sliding_windows
from maec_core.eval.report import read_report
from maec_core.eval.runner import evaluate, evaluate_many
from maec_core.eval.sets import load_spec
from maec_core.runtime import torch_threads
from tests.factories import bos_tokenizer

# The memorised model's world: numbered words, the numbers 0..99, a prompt vocabulary.
WORDS = [f"w{i}" for i in range(40)] + [str(i) for i in range(100)] + [
    "Question", "Answer", ":", "?", "the", "answer", "is"]
TEXTS = [
    "w1 w7 w3 w9 w4 w12 w30 w2 w8 w11 w5 w19 w22 w6 w13 w27 w10 w31 w0 w14",
    "w20 w3 w17 w25 w2 w33 w9 w1 w16 w28 w4 w35 w12 w7 w38 w21 w5 w26 w11 w36",
    "w15 w23 w18 w29 w34 w24 w32 w37 w39 w19 w6 w0 w10 w27 w14 w8 w30 w13 w2 w22",
]
QA = [("w5 w6 w7 ?", "42"), ("w8 w9 w10 ?", "17"), ("w11 w12 w13 ?", "8")]
UNSEEN_QA = [("w14 w15 w16 ?", "91"), ("w17 w18 w19 ?", "93"), ("w20 w21 w22 ?", "95")]
TEMPLATE = "Question : {question} Answer :"


def _tokenizer():
    return bos_tokenizer({"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3,
                          **{w: i + 4 for i, w in enumerate(WORDS)}})


def _train_memoriser(path: Path) -> Path:
    """A tiny Llama trained on TEXTS and on QA as ``TEMPLATE answer </s>`` (a few s)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = _tokenizer()
    seqs = [tok(t)["input_ids"] + [2] for t in TEXTS]
    seqs += [tok(TEMPLATE.replace("{question}", q) + " the answer is " + a)["input_ids"] + [2]
             for q, a in QA]
    width = max(map(len, seqs))
    x = torch.full((len(seqs), width), 3)
    labels = torch.full((len(seqs), width), -100)
    for i, s in enumerate(seqs):
        x[i, : len(s)] = torch.tensor(s)
        labels[i, : len(s)] = torch.tensor(s)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(WORDS) + 4, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128, bos_token_id=1, eos_token_id=2,
                      pad_token_id=3)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    mask = (x != 3).long()
    for _ in range(300):
        loss = model(input_ids=x, attention_mask=mask, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2, loss.item()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    # On a shared machine an OpenMP team stalls at every op of these tiny models
    # (training measured 20x slower with two threads on two busy cores).
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def memoriser(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train_memoriser(tmp_path_factory.mktemp("memoriser") / "model")


def _jsonl(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _spec(folder: Path, sets: list[dict[str, object]]) -> Path:
    import yaml

    spec = folder / "eval.yaml"
    spec.write_text(yaml.safe_dump({"sets": sets}))
    return spec


@pytest.fixture(scope="module")
def memorised_spec(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("sets")
    _jsonl(d / "texts.jsonl", [{"text": t} for t in TEXTS])
    (d / "unseen.txt").write_text("w3 w3 w0 w39 w5 w5 w5 w21\nw8 w1 w1 w17 w25\n\nw2 w2 w2 w2\n")
    (d / "qa.tsv").write_text("".join(f"{q}\t{a}\n" for q, a in QA))
    _jsonl(d / "unseen.jsonl", [{"question": q, "answer": int(a)} for q, a in UNSEEN_QA])
    return _spec(d, [
        {"name": "texts", "language": "sw", "kind": "perplexity", "path": "texts.jsonl"},
        {"name": "unseen-text", "language": "sw", "kind": "perplexity", "path": "unseen.txt"},
        {"name": "qa", "language": "sw", "kind": "accuracy", "path": "qa.tsv",
         "template": TEMPLATE, "max_new_tokens": 6, "batch_size": 2},
        {"name": "unseen-qa", "language": "en", "kind": "accuracy", "path": "unseen.jsonl",
         "template": TEMPLATE, "max_new_tokens": 6},
    ])


def test_memorised_sets_score_perfectly_and_unseen_sets_do_not(memoriser: Path,
                                                               memorised_spec: Path) -> None:
    report = evaluate(memoriser, memorised_spec, RunContext(device="cpu"), label="mem")
    (model,) = report.models
    r = {s.name: s for s in model.sets}
    # Every token after the first word of a text is determined by what came before;
    # only that first word (one of six memorised openings) is a guess.
    assert 1.0 <= r["texts"].value < 1.25
    assert r["texts"].count == sum(len(t.split()) for t in TEXTS)
    assert r["unseen-text"].value > 5.0
    assert r["qa"].value == 1.0 and r["qa"].correct == 3
    assert [it.output for it in r["qa"].items] == [f"the answer is {a}" for _, a in QA]
    assert r["unseen-qa"].value == 0.0 and r["unseen-qa"].count == 3
    for it in r["unseen-qa"].items:
        assert it.prompt == TEMPLATE.replace("{question}", it.question)
        assert it.extracted != it.answer and not it.correct
    assert model.dtype == "float32" and model.device == "cpu"
    assert r["texts"].settings["context"] == 128 and r["texts"].settings["stride"] == 64


def test_batched_generation_equals_one_at_a_time(memoriser: Path, tmp_path: Path) -> None:
    items = QA + UNSEEN_QA
    _jsonl(tmp_path / "qa.jsonl", [{"question": q, "answer": a} for q, a in items])
    outs = []
    for bs in (1, 4):
        spec = _spec(tmp_path, [{"name": "qa", "language": "sw", "kind": "accuracy",
                                 "path": "qa.jsonl", "template": TEMPLATE,
                                 "max_new_tokens": 6, "batch_size": bs}])
        (res,) = evaluate(memoriser, spec, RunContext(device="cpu")).models[0].sets
        outs.append([(it.output, it.extracted, it.correct, it.output_tokens) for it in res.items])
    assert outs[0] == outs[1]
    assert sum(c for _, _, c, _ in outs[0]) == 3


def test_stop_strings_cut_the_output(memoriser: Path, tmp_path: Path) -> None:
    (tmp_path / "qa.tsv").write_text("".join(f"{q}\t{a}\n" for q, a in QA))
    spec = _spec(tmp_path, [{"name": "qa", "language": "sw", "kind": "accuracy",
                             "path": "qa.tsv", "template": TEMPLATE, "max_new_tokens": 6,
                             "stop": ["is"]}])
    (res,) = evaluate(memoriser, spec, RunContext(device="cpu")).models[0].sets
    assert [it.output for it in res.items] == ["the answer "] * 3
    assert res.value == 0.0 and all(it.extracted is None for it in res.items)


def test_few_shot_exemplars_are_prompted_and_recorded(memoriser: Path, tmp_path: Path) -> None:
    (tmp_path / "qa.tsv").write_text("w5 w6 w7 ?\t42\n")
    (tmp_path / "shots.tsv").write_text("w1 w2 ?\tthe answer is 3\nw3 w4 ?\t4\nw9 ?\t9\n")
    spec = _spec(tmp_path, [{"name": "qa", "language": "sw", "kind": "accuracy",
                             "path": "qa.tsv", "template": TEMPLATE, "max_new_tokens": 4,
                             "few_shot": {"path": "shots.tsv", "k": 2,
                                          "language": "source"}}])
    (res,) = evaluate(memoriser, spec, RunContext(device="cpu")).models[0].sets
    expected = ("Question : w1 w2 ? Answer : the answer is 3\n\n"
                "Question : w3 w4 ? Answer : 4\n\n"
                "Question : w5 w6 w7 ? Answer :")
    assert res.items[0].prompt == expected
    assert res.settings["few_shot"] == {"path": str(tmp_path / "shots.tsv"), "k": 2,
                                        "language": "source"}


def _direct_perplexity(model, ids: torch.Tensor, context: int, stride: int) -> tuple[float, int]:
    """Summed NLL and scored tokens by the sliding-window recipe of the transformers docs,
    counting exactly the labels the shifted loss scores."""
    total, count, prev_end = 0.0, 0, 0
    n = ids.shape[1]
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        trg = end - prev_end
        inp = ids[:, begin:end]
        tgt = inp.clone()
        tgt[:, :-trg] = -100
        scored = int((tgt[:, 1:] != -100).sum())
        if scored:  # a one-token document has nothing to score (its loss is nan)
            with torch.no_grad():
                loss = model(input_ids=inp, labels=tgt).loss
            total += float(loss) * scored
            count += scored
        prev_end = end
        if end == n:
            break
    return total, count


@pytest.mark.parametrize(("context", "stride"), [(64, 32), (16, 8), (16, 16), (12, 5)])
def test_perplexity_equals_a_direct_transformers_computation(
        tiny_models, tmp_path: Path, context: int, stride: int) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    docs = [" ".join(f"w{(7 * i + 3) % 61}" for i in range(45)),
            " ".join(f"w{(11 * i + 5) % 61}" for i in range(23)), "w4"]
    _jsonl(tmp_path / "t.jsonl", [{"text": t} for t in docs])
    spec = _spec(tmp_path, [{"name": "t", "language": "sw", "kind": "perplexity",
                             "path": "t.jsonl", "context": context, "stride": stride,
                             "batch_size": 3}])
    (res,) = evaluate(tiny_models.base, spec, RunContext(device="cpu")).models[0].sets
    model = AutoModelForCausalLM.from_pretrained(tiny_models.base, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_models.base)
    nll, count = 0.0, 0
    for doc, got in zip(docs, res.documents, strict=True):
        ids = torch.tensor([tok(doc)["input_ids"]])
        d_nll, d_count = _direct_perplexity(model, ids, context, stride)
        assert got.tokens == d_count
        if stride < context:
            assert got.tokens == ids.shape[1] - 1
        assert got.nll == pytest.approx(d_nll, rel=1e-5, abs=1e-6)
        nll, count = nll + d_nll, count + d_count
    assert res.count == count
    assert res.value == pytest.approx(math.exp(nll / count), rel=1e-5)
    if context >= 45:
        # One window per document: the plain full-sequence loss of transformers.
        ids = torch.tensor([tok(docs[0])["input_ids"]])
        with torch.no_grad():
            loss = float(model(input_ids=ids, labels=ids).loss)
        assert res.documents[0].nll / res.documents[0].tokens == pytest.approx(loss, rel=1e-5)


def test_batched_perplexity_equals_one_window_at_a_time(tiny_models, tmp_path: Path) -> None:
    docs = [" ".join(f"w{(3 * i + k) % 61}" for i in range(20 + 9 * k)) for k in range(4)]
    _jsonl(tmp_path / "t.jsonl", [{"text": t} for t in docs])
    results = []
    for bs in (1, 5):
        spec = _spec(tmp_path, [{"name": "t", "language": "sw", "kind": "perplexity",
                                 "path": "t.jsonl", "context": 24, "stride": 10,
                                 "batch_size": bs}])
        results.append(evaluate(tiny_models.base, spec, RunContext(device="cpu")).models[0].sets[0])
    one, many = results
    assert one.count == many.count
    assert [d.tokens for d in one.documents] == [d.tokens for d in many.documents]
    for a, b in zip(one.documents, many.documents, strict=True):
        assert a.nll == pytest.approx(b.nll, rel=1e-5)
    assert one.value == pytest.approx(many.value, rel=1e-5)


def test_sliding_windows_score_every_token_once() -> None:
    for n in range(0, 40):
        for context in (2, 3, 7, 16):
            for stride in range(1, context + 1):
                windows = sliding_windows(n, context, stride)
                scored = [t for _, e, f in windows for t in range(f, e)]
                if stride < context:
                    assert scored == list(range(1, n)), (n, context, stride)
                else:  # disjoint windows: each one's first token has no context
                    assert scored == [t for t in range(1, n) if t % context], (n, context)
                assert all(e - s <= context and s < f for s, e, f in windows)
    with pytest.raises(ValueError):
        sliding_windows(10, 4, 5)


def test_evaluate_many_rows_models_columns_sets(tiny_models, memoriser: Path,
                                                memorised_spec: Path, tmp_path: Path) -> None:
    spec = load_spec(memorised_spec)
    seen: list[tuple[str, int, int]] = []
    report = evaluate_many(
        {"mem": memoriser, "base": tiny_models.base},
        spec.model_copy(update={"sets": spec.sets[:2]}),
        RunContext(
            device="cpu", progress=lambda stage, done, total: seen.append((stage, done, total))
        ),
    )
    assert [m.label for m in report.models] == ["mem", "base"]
    table = report.table
    assert [c["name"] for c in table["columns"]] == ["texts", "unseen-text"]
    assert [r["model"] for r in table["rows"]] == ["mem", "base"]
    assert table["rows"][0]["cells"]["texts"] < table["rows"][1]["cells"]["texts"]
    assert ("mem: texts", 1, 1) in seen and ("base: unseen-text", 1, 1) in seen
    text = report.text_table()
    assert text.splitlines()[0].split() == ["model", "texts", "[sw]", "unseen-text", "[sw]"]
    assert report.markdown_table().startswith("| model | texts [sw] | unseen-text [sw] |\n")


def test_evaluate_many_holds_one_model_at_a_time(tiny_models, memoriser: Path,
                                                 memorised_spec: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import weakref

    from maec_core.eval import runner

    alive: list[weakref.ref[object]] = []
    real_load = runner.load_model

    def load(model_dir, device):
        gone = [ref() is None for ref in alive]
        assert all(gone), "the previous model is still in memory"
        loaded = real_load(model_dir, device)
        alive.append(weakref.ref(loaded.model))
        return loaded

    monkeypatch.setattr(runner, "load_model", load)
    spec = load_spec(memorised_spec)
    report = evaluate_many(
        {"a": memoriser, "b": tiny_models.base, "c": memoriser},
        spec.model_copy(update={"sets": spec.sets[:1]}),
        RunContext(device="cpu"),
    )
    assert [m.label for m in report.models] == ["a", "b", "c"] and len(alive) == 3
    assert all(ref() is None for ref in alive)


def test_cancel_stops_between_batches(memoriser: Path, memorised_spec: Path) -> None:
    with pytest.raises(Cancelled):
        evaluate(memoriser, memorised_spec, RunContext(device="cpu", cancel=lambda: True))


def test_context_beyond_the_model_is_refused(tiny_models, tmp_path: Path) -> None:
    _jsonl(tmp_path / "t.jsonl", [{"text": "w1 w2 w3"}])
    spec = _spec(tmp_path, [{"name": "t", "language": "sw", "kind": "perplexity",
                             "path": "t.jsonl", "context": 4096}])
    with pytest.raises(EvalSetError, match="exceeds the model's 64 positions"):
        evaluate(tiny_models.base, spec, RunContext(device="cpu"))


def test_cli_prints_the_table_and_writes_every_item(memoriser: Path, memorised_spec: Path,
                                                    tmp_path: Path) -> None:
    from maec_core.cli import main

    out = tmp_path / "report.json"
    res = CliRunner().invoke(main, ["eval", str(memoriser), str(memorised_spec), "--out",
                                    str(out), "--device", "cpu", "--no-progress"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].split()[:3] == ["model", "texts", "[sw]"]
    assert lines[2].startswith("model ") and "acc 1.000 (3/3)" in lines[2]
    assert "acc 0.000 (0/3)" in lines[2]
    report = read_report(out)
    qa = report.models[0].result("qa")
    assert qa is not None and len(qa.items) == 3 and qa.items[0].output
    assert json.loads(out.read_text())["table"]["rows"][0]["cells"]["qa"] == 1.0

    md = CliRunner().invoke(main, ["eval", str(memoriser), str(memorised_spec), "--out",
                                   str(out), "--device", "cpu", "--no-progress", "--markdown",
                                   "--label", "merged"])
    assert md.exit_code == 0 and md.stdout.startswith("| model | texts [sw] |")
    assert "| merged |" in md.stdout


def test_cli_reports_a_bad_set_with_its_code(memoriser: Path, tmp_path: Path) -> None:
    from maec_core.cli import main

    (tmp_path / "qa.jsonl").write_text('{"question": "w1 ?", "answer": 3}\n{"question": \n')
    spec = _spec(tmp_path, [{"name": "qa", "language": "sw", "kind": "accuracy",
                             "path": "qa.jsonl"}])
    res = CliRunner().invoke(main, ["eval", str(memoriser), str(spec), "--out",
                                    str(tmp_path / "r.json"), "--no-progress"])
    assert res.exit_code == 2
    assert "[invalid_eval_set] qa.jsonl line 2: not JSON" in res.stderr
    assert not (tmp_path / "r.json").exists()


def _definition(folder: Path, to: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """``folder``'s files but its weights, copied to ``to``; and its weights."""
    import shutil

    from safetensors.torch import load_file

    to.mkdir()
    weights: dict[str, torch.Tensor] = {}
    for f in folder.iterdir():
        if f.suffix == ".safetensors":
            weights.update(load_file(f))
        else:
            shutil.copy(f, to / f.name)
    return to, weights


def _same_model(built: object, loaded: object) -> None:
    """The same tensors (parameters and buffers, by name, dtype and value), ties,
    generation config and mode."""
    a, b = built.model, loaded.model  # type: ignore[attr-defined]
    for named in ("named_parameters", "named_buffers"):
        got = dict(getattr(a, named)(remove_duplicate=False))
        want = dict(getattr(b, named)(remove_duplicate=False))
        assert got.keys() == want.keys(), named
        for name, t in want.items():
            assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert dict(a.named_parameters()).keys() == dict(b.named_parameters()).keys()  # ties
    assert a.generation_config.to_dict() == b.generation_config.to_dict()
    assert not a.training and not b.training
    assert type(a) is type(b)
    assert built.tokenizer.get_vocab() == loaded.tokenizer.get_vocab()  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["untied", "tied-bf16", "memoriser", "no-generation-config"])
def test_a_model_built_from_its_definition_files_then_filled_is_the_loaded_model(
        memoriser: Path, tmp_path: Path, kind: str) -> None:
    """What a sweep scores its candidates with: the model built from a checkpoint's
    files but its weights, then given them, holds what a load of the checkpoint holds
    (the rotary buffers a load computes, a tied head, the generation config, the
    float32 a CPU scores in)."""
    from maec_core.eval.loading import build_model, load_model
    from tests.factories import make_llama

    if kind == "memoriser":
        folder = memoriser
    else:
        folder = make_llama(tmp_path / "model", 3, tie_word_embeddings=kind == "tied-bf16",
                            dtype=torch.bfloat16 if kind == "tied-bf16" else torch.float32)
    if kind == "no-generation-config":
        (folder / "generation_config.json").unlink()
    definition, weights = _definition(folder, tmp_path / "definition")
    cpu = torch.device("cpu")
    seen: list[set[str]] = []
    built = build_model(definition, cpu, set(weights),
                        check=lambda m: seen.append({p.device.type for p in m.parameters()}))
    # The check saw the model before any of it had memory.
    assert seen == [{"meta"}]
    params = dict(built.model.named_parameters())
    with torch.no_grad():
        for name, t in weights.items():
            if name in params:
                params[name].copy_(t)
    _same_model(built, load_model(folder, cpu))


def test_half_precision_keeps_what_a_load_keeps_in_float32(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An architecture that keeps some weights in float32 when loaded in half
    precision gets them in float32 when built, as a load gives them."""
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaForCausalLM

    from maec_core.eval.loading import _keep_float32
    from tests.factories import make_llama

    folder = make_llama(tmp_path / "model", 3, dtype=torch.bfloat16)
    monkeypatch.setattr(LlamaForCausalLM, "_keep_in_fp32_modules_strict", ["mlp.gate_proj"])
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.device("meta"):
        built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder),
                                                 dtype=torch.bfloat16)
    _keep_float32(built, torch.bfloat16)
    want = {n: p.dtype for n, p in loaded.named_parameters()}
    assert {n: p.dtype for n, p in built.named_parameters()} == want
    assert want["model.layers.0.mlp.gate_proj.weight"] == torch.float32
    assert want["model.layers.0.mlp.up_proj.weight"] == torch.bfloat16


def test_a_model_is_built_in_the_dtype_it_loads_in(tmp_path: Path) -> None:
    """float32 on a CPU; on an accelerator the stored dtype, which a merge's config
    states (a load's ``"auto"``)."""
    from transformers import AutoConfig

    from maec_core.eval.loading import _dtype_of, eval_dtype
    from tests.factories import make_llama

    config = AutoConfig.from_pretrained(make_llama(tmp_path / "m", 3, dtype=torch.bfloat16))
    assert eval_dtype(torch.device("cpu")) == torch.float32
    assert eval_dtype(torch.device("cuda")) == "auto"
    assert _dtype_of(config, torch.device("cpu")) == torch.float32
    assert _dtype_of(config, torch.device("cuda")) == torch.bfloat16
