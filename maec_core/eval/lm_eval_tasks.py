"""lm-evaluation-harness tasks as eval sets (``kind: lm_eval``), run by lm-eval itself.

The task names people compare models by (``mgsm_direct_bn``, ``arc_easy``,
``global_mmlu_sw``) are lm-eval's, and so are its prompts, answer filters and metrics: a
figure from here is one lm-eval gives for the same model, so it can stand beside a
leaderboard's. lm-eval runs as a library around the model already loaded (its ``HFLM``
wraps our model and tokenizer objects), on the device the evaluation uses.

Where tasks and their data come from:

- lm-eval's own tasks, and the task folders of ``MAEC_LM_EVAL_TASK_DIRS`` (plus, for a
  local run, an lm_eval set's ``path``). A task YAML may import Python (lm-eval's
  ``!function``), so in the service only the operator's folders are read.
- A task whose ``dataset_path`` is a file format (``json``, ``csv``, ``parquet``, ...)
  reads its relative ``data_files`` from ``MAEC_LM_EVAL_DATA_DIR`` when set, else from
  its YAML's folder. A task whose data is a Hub dataset reads it from the datasets cache
  (``HF_DATASETS_CACHE``) offline, unless ``MAEC_LM_EVAL_HUB`` allows the Hub.

lm-eval imports torch and more (about two seconds): it is imported on first use only,
once per process, and never by the API (names are checked there by
:func:`task_names_in`, from the YAML files alone).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import math
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maec_core.errors import Cancelled, EvalSetError, LmEvalFailed, LmEvalTaskUnknown
from maec_core.eval.report import SetResult

TASK_DIRS_ENV = "MAEC_LM_EVAL_TASK_DIRS"
DATA_DIR_ENV = "MAEC_LM_EVAL_DATA_DIR"
HUB_ENV = "MAEC_LM_EVAL_HUB"
# dataset_path values that are datasets' file readers, not Hub dataset ids: their
# data_files are local paths.
FILE_BUILDERS = frozenset({"json", "csv", "parquet", "text", "arrow", "pandas"})
# A task YAML's top-level name keys, as lm-eval indexes them (quoted or not), a list
# item under a key, and an include (a template whose tags the task inherits).
_KEY = re.compile(r"""^['"]?(task|group|tag|include)['"]?\s*:\s*(.*?)\s*$""")
_ITEM = re.compile(r"""^\s+-\s*['"]?([^'"\s#]+)['"]?\s*$""")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._()-]*$")
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9._()-]*")
YAML_MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class LmEvalConfig:
    """Where lm-eval's tasks and data come from (the worker's ``MAEC_LM_EVAL_*``)."""

    task_dirs: tuple[Path, ...] = ()
    data_dir: Path | None = None
    hub: bool = False

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> LmEvalConfig:
        env = os.environ if env is None else env
        dirs = tuple(Path(p) for p in env.get(TASK_DIRS_ENV, "").split(os.pathsep) if p)
        data = env.get(DATA_DIR_ENV) or None
        hub = env.get(HUB_ENV, "").strip().lower() in ("1", "true", "yes", "on")
        return cls(task_dirs=dirs, data_dir=Path(data) if data else None, hub=hub)


# ------------------------------------------------------------- names, without lm-eval


def task_names_in(folders: Iterable[Path]) -> set[str]:
    """The task, group and tag names the YAML files under ``folders`` declare, read as
    text (no YAML tag is resolved, no code imported): what the API checks names with."""
    names: set[str] = set()
    for folder in folders:
        if not folder.is_dir():
            continue
        for path in sorted(folder.rglob("*.yaml")):
            names |= _names_in_file(path)
    return names


def _names_in_file(path: Path) -> set[str]:
    """The names ``path`` declares, with the tags of the templates it includes."""
    keys = _keys(path)
    return {n for k in ("task", "group", "tag") for n in keys.get(k, [])}


def _keys(path: Path, depth: int = 0) -> dict[str, list[str]]:
    """The top-level task/group/tag/include values of a YAML file (a scalar, an inline
    list or a block list), includes followed up to four deep."""
    try:
        if not path.is_file() or path.stat().st_size > YAML_MAX_BYTES:
            return {}
        lines = path.read_text(encoding="utf-8", errors="replace").split("\n")
    except OSError:
        return {}
    out: dict[str, list[str]] = {}
    for i, line in enumerate(lines):
        m = _KEY.match(line)
        if m is None:
            continue
        key, value = m.group(1), m.group(2).split(" #")[0].strip()
        if value.startswith("["):
            items = [v.strip(" '\"") for v in value.strip("[]").split(",")]
        elif value:
            items = [value.strip("'\"")]
        else:
            items = []
            for item in lines[i + 1:]:
                im = _ITEM.match(item)
                if im is None:
                    break
                items.append(im.group(1))
        if key == "include":
            out.setdefault(key, []).extend(items)
        else:
            out.setdefault(key, []).extend(v for v in items if _NAME.match(v))
    if depth < 4:
        for inc in out.get("include", []):
            inherited = _keys(path.parent / inc, depth + 1)
            out.setdefault("tag", []).extend(inherited.get("tag", []))
            if "task" not in out and "task" in inherited:
                out["task"] = list(inherited["task"])
    return out


def within(path: Path, roots: Iterable[Path]) -> bool:
    """Whether ``path`` (links and ``..`` resolved) lies inside one of ``roots``."""
    full = path.resolve()
    return any(full.is_relative_to(r.resolve()) for r in roots)


@functools.lru_cache(maxsize=1)
def _builtin_roots() -> tuple[Path, ...] | None:
    """lm-eval's own task folder, found without importing it (None when it is not
    installed here)."""
    import importlib.util

    found = importlib.util.find_spec("lm_eval")
    if found is None or not found.submodule_search_locations:
        return None
    return tuple(Path(p) / "tasks" for p in found.submodule_search_locations)


@functools.lru_cache(maxsize=1)
def builtin_task_names() -> frozenset[str] | None:
    """Every name-like word of lm-eval's own task files (YAML, templates, Python), read
    once without importing lm-eval; None when it is not installed here (the worker
    checks then). A superset of its task, group and tag names, as its index also makes
    names in Python and from templates: none of its names is refused, and a word that
    names no task fails in the worker with the same code."""
    roots = _builtin_roots()
    if roots is None:
        return None
    words: set[str] = set()
    for root in roots:
        for path in root.rglob("*"):
            # Templates are often named without a suffix ("mafand", "direct_yaml").
            if path.suffix not in (".yaml", ".py", "") or not path.is_file():
                continue
            try:
                words.update(_WORD.findall(path.read_text(encoding="utf-8",
                                                          errors="replace")))
            except OSError:
                continue
    return frozenset(words)


def check_lm_eval_sets(specs: Iterable[Any], config: LmEvalConfig) -> None:
    """Refuse, before a job is queued, an lm_eval set whose folder is not an operator's
    task folder or whose task no known folder declares (EvalSetError, or
    LmEvalTaskUnknown). Task names are read from the YAML files as text, lm-eval's own
    (:func:`builtin_task_names`) only when a name is not in the configured folders."""
    for spec in specs:
        if spec.kind != "lm_eval":
            continue
        dirs = list(config.task_dirs)
        if spec.path is not None:
            if not within(Path(spec.path), config.task_dirs):
                raise EvalSetError(f"eval set {spec.name!r}: {spec.path} is not in a task "
                                   "folder of MAEC_LM_EVAL_TASK_DIRS", set=spec.name)
            dirs.append(Path(spec.path))
        task = spec.lm_eval_task
        if task in task_names_in(dirs):
            continue
        builtin = builtin_task_names()
        if builtin is not None and task not in builtin:
            raise LmEvalTaskUnknown(f"eval set {spec.name!r}: lm-eval knows no task {task!r} "
                                    "(its own tasks and MAEC_LM_EVAL_TASK_DIRS)",
                                    set=spec.name, task=task)


# ------------------------------------------------------------------- running lm-eval


def _lm_eval() -> Any:
    try:
        import lm_eval
    except ImportError:
        raise LmEvalFailed("lm-evaluation-harness is not installed on this worker "
                           "(the lm-eval extra: pip install 'maec-service[lm-eval]')"
                           ) from None
    return lm_eval


@contextlib.contextmanager
def _offline(hub: bool) -> Iterator[None]:
    """Keep datasets and huggingface_hub off the Hub while lm-eval runs, unless it is
    allowed. Both read these variables when imported, so their module constants are set
    too; everything is put back after, as the process may fetch for other work."""
    if hub:
        yield
        return
    import datasets.config
    import huggingface_hub.constants

    names = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
    saved_env = {k: os.environ.get(k) for k in names}
    saved = (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)
    os.environ.update(dict.fromkeys(names, "1"))
    datasets.config.HF_HUB_OFFLINE = huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE = saved
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@functools.lru_cache(maxsize=8)
def _manager(dirs: tuple[str, ...], defaults: bool) -> Any:
    """lm-eval's task index over ``dirs`` (and its own tasks with ``defaults``): built
    once per process, as indexing lm-eval's own tasks reads thousands of YAML files."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=list(dirs) or None, include_defaults=defaults)


def find_task(task: str, dirs: tuple[str, ...]) -> Any:
    """The task manager that knows ``task``: the folders' alone when they hold it
    (cheap), else with lm-eval's own tasks. :class:`LmEvalTaskUnknown` if neither."""
    if dirs:
        local = _manager(dirs, False)
        if task in local.all_tasks:
            return local
    full = _manager(dirs, True)
    if task in full.all_tasks:
        return full
    raise LmEvalTaskUnknown(f"lm-eval knows no task {task!r} (its own tasks and the "
                            "configured task folders)", task=task)


def _task_spec(manager: Any, task: str, data_dir: Path | None) -> str | dict[str, Any]:
    """``task`` as lm-eval loads it: by name, or, for a task reading local files, its
    config with the folder its relative ``data_files`` are read from."""
    entry = manager.task_index.get(task)
    yaml_path = getattr(entry, "yaml_path", None)
    if yaml_path is None or getattr(entry, "kind", None) is None \
            or str(entry.kind.name) != "TASK":
        return task
    # lm-eval's own loader resolves `include:` and `!function` as loading by name does.
    from lm_eval.tasks._yaml_loader import load_yaml

    cfg = dict(load_yaml(yaml_path, resolve_func=True))
    if cfg.get("dataset_path") not in FILE_BUILDERS:
        return task
    kwargs = dict(cfg.get("dataset_kwargs") or {})
    # datasets reads relative data_files from data_dir (else the working directory).
    kwargs.setdefault("data_dir", str(data_dir or Path(yaml_path).parent))
    return {**cfg, "dataset_kwargs": kwargs}


def _metric_key(key: str) -> str:
    """lm-eval's result key as its own table names it: the filter kept unless "none"."""
    return key.removesuffix(",none")


def _metrics(results: Mapping[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """A task's results as ({metric: value}, {metric: stderr}), lm-eval's names."""
    values: dict[str, float] = {}
    stderr: dict[str, float] = {}
    for key, value in results.items():
        if "," not in key or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        metric, _, flt = key.partition(",")
        if metric.endswith("_stderr"):
            stderr[_metric_key(f"{metric.removesuffix('_stderr')},{flt}")] = float(value)
        else:
            values[_metric_key(key)] = float(value)
    return values, stderr


def run_lm_eval(model: Any, tokenizer: Any, device: Any, spec: Any,
                on_batch: Callable[[int, int], None], cancel: Callable[[], bool] | None,
                config: LmEvalConfig | None = None) -> SetResult:
    """Run the lm_eval set ``spec`` (an :class:`~maec_core.eval.sets.EvalSetSpec`) on a
    loaded model with lm-eval's ``simple_evaluate``; the set's value is ``spec.metric``
    (default: the task's first metric), every metric is kept under lm-eval's name."""
    config = config or LmEvalConfig.from_env()
    lm_eval = _lm_eval()
    if cancel is not None and cancel():
        raise Cancelled("evaluation cancelled")
    t0 = time.perf_counter()
    task = spec.lm_eval_task
    dirs = tuple(str(d) for d in (*config.task_dirs, *([spec.path] if spec.path else [])))
    manager = find_task(task, dirs)
    from lm_eval.models.huggingface import HFLM

    on_batch(0, 1)
    # lm-eval sets a missing pad token on the tokenizer it is given: a copy, so our own
    # sets scored with the same tokenizer (a sweep's slot keeps it) see it unchanged.
    lm = HFLM(pretrained=model, tokenizer=copy.deepcopy(tokenizer),
              batch_size=spec.batch_size, device=str(device))
    try:
        with _offline(config.hub):
            out = lm_eval.simple_evaluate(
                model=lm, tasks=[_task_spec(manager, task, config.data_dir)],
                task_manager=manager, limit=spec.limit, num_fewshot=spec.num_fewshot,
                log_samples=False)
    except (LmEvalTaskUnknown, EvalSetError, Cancelled):
        raise
    except Exception as exc:  # lm-eval's and datasets' own errors have no common base
        raise LmEvalFailed(f"lm-eval could not run task {task!r}: "
                           f"{type(exc).__name__}: {str(exc)[:300]}", task=task) from None
    finally:
        # The wrapper holds the model: drop it so the caller can free the weights.
        del lm
    on_batch(1, 1)
    return _result(spec, task, out, time.perf_counter() - t0)


def _result(spec: Any, task: str, out: Mapping[str, Any], seconds: float) -> SetResult:
    results = (out or {}).get("results", {}).get(task)
    if not isinstance(results, Mapping):
        raise LmEvalFailed(f"lm-eval returned no result for {task!r} (a group without an "
                           "aggregate score has none: name one of its tasks)", task=task)
    values, stderr = _metrics(results)
    if not values:
        raise LmEvalFailed(f"lm-eval's result for task {task!r} has no metric", task=task)
    metric = spec.metric or next(iter(values))
    if metric not in values:
        raise EvalSetError(f"eval set {spec.name!r}: task {task!r} has no metric {metric!r} "
                           f"(it reports {', '.join(values)})", set=spec.name)
    samples = (out.get("n-samples") or {}).get(task) or {}
    count = int(samples.get("effective", results.get("sample_len", 0)) or 0)
    value = values[metric]
    settings = {"task": task, "path": spec.path, "limit": spec.limit,
                "num_fewshot": spec.num_fewshot, "batch_size": spec.batch_size,
                "n_shot": (out.get("n-shot") or {}).get(task),
                "higher_is_better": (out.get("higher_is_better") or {}).get(task),
                "lm_eval_version": out.get("lm_eval_version")}
    return SetResult(name=spec.name, language=spec.language, kind="lm_eval",
                     value=value if math.isfinite(value) else math.nan, count=count,
                     seconds=seconds, settings=settings, metric=metric, metrics=values,
                     stderr=stderr)
