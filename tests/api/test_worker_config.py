"""The reviewed Celery reliability settings (worker/celery_config.py) hold."""

from __future__ import annotations

import subprocess
import sys

from app.settings import Settings, hash_key
from tests.stack import ROOT
from worker.celery_config import celery_settings


def test_reliability_settings() -> None:
    s = Settings(api_keys={"a": hash_key("a")}, task_time_limit=3600)
    conf = celery_settings(s)
    assert conf["task_acks_late"] is True and conf["task_reject_on_worker_lost"] is True
    assert conf["worker_prefetch_multiplier"] == 1
    assert conf["worker_max_tasks_per_child"] == 1
    assert conf["task_time_limit"] == 3600 and conf["task_soft_time_limit"] < 3600
    for key in ("broker_transport_options", "result_backend_transport_options"):
        assert conf[key]["visibility_timeout"] > conf["task_time_limit"], key
    assert conf["task_serializer"] == conf["result_serializer"] == "json"
    assert conf["accept_content"] == conf["result_accept_content"] == ["json"]


def test_worker_parent_never_initialises_cuda() -> None:
    code = (
        "import os; os.environ.setdefault('MAEC_DEV_MODE', 'true');"
        "import worker.celery_app, worker.tasks, torch;"
        "print(torch.cuda.is_initialized(), 'fastapi' in __import__('sys').modules,"
        " any(m.startswith('app.api') for m in __import__('sys').modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, check=True, env={"PATH": "/usr/bin", "MAEC_DEV_MODE": "true",
                                                     "MAEC_PRELOAD_MODULES": "[]"})
    assert out.stdout.split() == ["False", "False", "False"]
