"""Evaluate model folders on an eval spec, one model in memory at a time.

Each folder is loaded as :mod:`maec_core.eval.loading` loads it (the same checks as a
merge input, transformers from the folder alone: never a hub, never remote code).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from maec_core.context import RunContext
from maec_core.errors import EvalSetError
from maec_core.eval.answers import extract_answer, is_correct
from maec_core.eval.loading import LoadedModel, load_model, release
from maec_core.eval.measure import BatchHooks, generate, score_texts
from maec_core.eval.report import AccuracyItem, EvalReport, ModelResult, SetResult
from maec_core.eval.sets import EvalSpec, LoadedSet, load_sets, load_spec
from maec_core.runtime import CancelFn, best_device

# Perplexity context when the spec leaves it open: the model's window, at most this.
DEFAULT_CONTEXT = 1024


def evaluate(model_dir: str | Path, spec: EvalSpec | str | Path,
             ctx: RunContext | None = None, *, label: str | None = None) -> EvalReport:
    """Score one model folder on every set of ``spec`` (a parsed spec or a spec file).
    Of ``ctx`` the device, progress and cancel apply."""
    name = label or Path(model_dir).name
    return evaluate_many({name: model_dir}, spec, ctx)


def evaluate_many(models: Mapping[str, str | Path], spec: EvalSpec | str | Path,
                  ctx: RunContext | None = None) -> EvalReport:
    """Score several folders ``{label: folder}``, one at a time, freeing each model
    before loading the next. The sets are read (and checked) once, before any model."""
    sets = load_sets(load_spec(spec) if isinstance(spec, str | Path) else spec)
    ctx = ctx or RunContext()
    return EvalReport(models=[_evaluate_one(label, folder, sets, ctx)
                              for label, folder in models.items()])


def evaluate_loaded(label: str, model_dir: str | Path, sets: list[LoadedSet],
                    ctx: RunContext) -> ModelResult:
    """Score one folder on sets already read (a sweep reads its sets once and scores
    every candidate with them), freeing the model before returning."""
    return _evaluate_one(label, model_dir, sets, ctx)


def _evaluate_one(label: str, model_dir: str | Path, sets: list[LoadedSet],
                  ctx: RunContext) -> ModelResult:
    device = best_device(ctx.device)
    t0 = time.perf_counter()
    loaded = load_model(model_dir, device)
    alive = loaded.references()
    try:
        results = [evaluate_set(loaded, s, ctx, stage=label) for s in sets]
        dtype = loaded.dtype
    finally:
        # Drop the only reference before the next model loads.
        del loaded
        release(alive, device)
    return ModelResult(label=label, model_dir=str(model_dir), device=str(device),
                       dtype=dtype, seconds=time.perf_counter() - t0, sets=results)


def evaluate_set(loaded: LoadedModel, s: LoadedSet, ctx: RunContext, *,
                 stage: str = "eval") -> SetResult:
    """Score one loaded set with an already loaded model (``ctx``'s progress and cancel
    apply; its device is the model's)."""
    progress, cancel = ctx.progress, ctx.cancel
    where = f"{stage}: {s.spec.name}"

    def on_batch(done: int, total: int) -> None:
        if progress is not None:
            progress(where, done, total)

    if s.spec.kind == "lm_eval":
        from maec_core.eval.lm_eval_tasks import run_lm_eval

        return run_lm_eval(loaded.model, loaded.tokenizer, loaded.device, s.spec,
                           on_batch, cancel)
    if s.spec.kind == "perplexity":
        return _perplexity(loaded, s, on_batch, cancel)
    return _accuracy(loaded, s, on_batch, cancel)


def _window(loaded: LoadedModel, s: LoadedSet) -> tuple[int, int]:
    """The context and stride used for this model: the spec's, or the model's window
    (at most DEFAULT_CONTEXT) with half of it as stride."""
    limit = loaded.max_positions
    context = s.spec.context or min(DEFAULT_CONTEXT, limit or DEFAULT_CONTEXT)
    if limit is not None and context > limit:
        raise EvalSetError(f"eval set {s.spec.name!r}: context {context} exceeds the "
                           f"model's {limit} positions", set=s.spec.name)
    stride = s.spec.stride or max(1, context // 2)
    if stride > context:
        raise EvalSetError(f"eval set {s.spec.name!r}: stride {stride} is larger than "
                           f"context {context}", set=s.spec.name)
    return context, stride


def _perplexity(loaded: LoadedModel, s: LoadedSet, on_batch: Callable[[int, int], None],
                cancel: CancelFn | None) -> SetResult:
    t0 = time.perf_counter()
    spec = s.spec
    context, stride = _window(loaded, s)
    docs = score_texts(loaded.model, loaded.tokenizer, s.texts, context=context,
                       stride=stride, batch_size=spec.batch_size, device=loaded.device,
                       hooks=BatchHooks(on_batch, cancel))
    tokens = sum(d.tokens for d in docs)
    if tokens == 0:
        raise EvalSetError(f"eval set {spec.name!r} has no token to score (every document "
                           "is one token long)", set=spec.name)
    mean = sum(d.nll for d in docs) / tokens
    settings = {"path": spec.path, "format": spec.file_format, "context": context,
                "stride": stride, "batch_size": spec.batch_size,
                "max_items": spec.max_items, "documents": len(docs)}
    return SetResult(name=spec.name, language=spec.language, kind="perplexity",
                     value=math.exp(mean) if mean < 700 else math.inf, count=tokens,
                     mean_nll=mean, seconds=time.perf_counter() - t0, settings=settings,
                     documents=docs)


def _accuracy(loaded: LoadedModel, s: LoadedSet, on_batch: Callable[[int, int], None],
              cancel: CancelFn | None) -> SetResult:
    t0 = time.perf_counter()
    spec = s.spec
    prompts = [s.prompt(item.question) for item in s.items]
    outputs = generate(loaded.model, loaded.tokenizer, prompts,
                       max_new_tokens=spec.new_tokens, batch_size=spec.batch_size,
                       stop=spec.stop_strings, device=loaded.device,
                       hooks=BatchHooks(on_batch, cancel))
    items = []
    for i, (item, prompt, out) in enumerate(zip(s.items, prompts, outputs, strict=True)):
        extracted = extract_answer(out.output)
        items.append(AccuracyItem(index=i, question=item.question, answer=item.answer,
                                  prompt=prompt, output=out.output, extracted=extracted,
                                  correct=is_correct(extracted, item.answer),
                                  output_tokens=out.tokens))
    correct = sum(it.correct for it in items)
    shot = spec.few_shot
    settings = {
        "path": spec.path, "format": spec.file_format, "template": spec.prompt_template,
        "few_shot": ({"path": shot.path, "k": shot.k, "language": shot.language}
                     if shot is not None else None),
        "max_new_tokens": spec.new_tokens, "stop": spec.stop_strings,
        "batch_size": spec.batch_size, "max_items": spec.max_items,
    }
    return SetResult(name=spec.name, language=spec.language, kind="accuracy",
                     value=correct / len(items), count=len(items), correct=correct,
                     seconds=time.perf_counter() - t0, settings=settings, items=items)
