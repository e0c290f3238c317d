"""docker-compose.yml and Dockerfile, checked without a Docker engine: they parse, every
command of our images names a real entry point, and the images install the README's pins.
"""

from __future__ import annotations

import importlib.util
import re
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return dict(yaml.safe_load((ROOT / "docker-compose.yml").read_text()))


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def _console_scripts() -> set[str]:
    return {ep.name for ep in metadata.entry_points(group="console_scripts")}


def _check_command(cmd: list[str]) -> None:
    """The executable is an installed console script; module references resolve."""
    assert cmd[0] in _console_scripts(), cmd[0]
    if cmd[0] == "uvicorn":
        module, _, attr = cmd[1].partition(":")
        assert importlib.util.find_spec(module) is not None, module
        source = Path(importlib.util.find_spec(module).origin or "").read_text()  # type: ignore[union-attr]
        assert f"def {attr}(" in source, cmd[1]
    if cmd[0] == "celery":
        app = cmd[cmd.index("-A") + 1]
        assert importlib.util.find_spec(app) is not None, app
        assert cmd[cmd.index("-Q") + 1] == "merges"


def test_compose_has_the_services(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"api", "worker", "redis", "s3", "flower"}
    gpu = services["worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert "./deploy/redis.conf:/usr/local/etc/redis/redis.conf:ro" in services["redis"][
        "volumes"]
    assert services["redis"]["command"][1] == "/usr/local/etc/redis/redis.conf"
    for name in ("api", "worker"):
        env = services[name]["environment"]
        assert env["MAEC_STORAGE_BACKEND"] == "s3"
        assert env["MAEC_REDIS_URL"].startswith("redis://redis:")
        # Secrets come from .env; the file itself holds none.
        for key in ("MAEC_API_KEYS", "MAEC_S3_ACCESS_KEY", "MAEC_S3_SECRET_KEY"):
            assert env[key].startswith("${") and ":?" in env[key], key
    for port in [p for s in services.values() for p in s.get("ports", [])]:
        assert port.startswith("127.0.0.1:"), "nothing published beyond localhost"


def test_compose_commands_name_real_entry_points(compose: dict[str, Any],
                                                 dockerfile: str) -> None:
    stages = set(re.findall(r"^FROM \S+ AS (\S+)", dockerfile, re.M))
    for name in ("api", "worker"):
        svc = compose["services"][name]
        assert svc["build"]["target"] in stages
        _check_command(svc["command"])
    assert compose["services"]["flower"]["command"][:2] == [
        "celery", "--broker=redis://redis:6379/0"]


def test_dockerfile_cmds_name_real_entry_points(dockerfile: str) -> None:
    import json

    cmds = [json.loads(m.replace("\\\n", " "))
            for m in re.findall(r"^CMD (\[.*?\])\s*$", dockerfile, re.M | re.S)]
    assert len(cmds) == 2
    for cmd in cmds:
        _check_command(cmd)


def test_images_install_the_readme_pins(dockerfile: str) -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    torch_pin = next(d for d in deps if d.startswith("torch=="))
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    assert torch_pin in setup, "the README's setup pins the same torch"
    installs = re.findall(r"^RUN pip install (.+)$", dockerfile, re.M)
    assert sum(torch_pin in line for line in installs) == 2, "both images pin torch"
    assert any("download.pytorch.org/whl/cpu" in line for line in installs), "CPU API image"
    assert installs.count(".") == 1, "the API image installs the package with its pins"
    # The worker image adds the worker's extra (lm-evaluation-harness) to the same pins.
    assert installs.count('".[lm-eval]"') == 1, "the worker image installs its extra"
    for stage in ("build-cpu", "build-cuda"):
        assert f"AS {stage}" in dockerfile


def test_redis_conf_is_durable_and_never_evicts() -> None:
    conf = (ROOT / "deploy" / "redis.conf").read_text()
    lines = {ln.split()[0]: ln.split()[1:] for ln in conf.splitlines()
             if ln.strip() and not ln.startswith("#")}
    assert lines["appendonly"] == ["yes"]
    assert lines["maxmemory-policy"] == ["noeviction"]
    assert lines["appendfsync"] == ["everysec"]


def test_compose_and_image_believe_forwarded_addresses_from_nobody_by_default(
        compose: dict[str, Any], dockerfile: str) -> None:
    """uvicorn's own default trusts X-Forwarded-For from 127.0.0.1 (anything inside the
    container): the api image sets FORWARDED_ALLOW_IPS empty and compose passes the
    operator's value, empty unless .env names a proxy. The metrics token comes from .env
    too, to the API only."""
    api_stage = dockerfile[dockerfile.index("AS api"):]
    api_stage = api_stage[:api_stage.index("\nFROM ")]
    assert re.search(r'^ENV FORWARDED_ALLOW_IPS=""$', api_stage, re.M)
    env = compose["services"]["api"]["environment"]
    assert env["FORWARDED_ALLOW_IPS"] == "${FORWARDED_ALLOW_IPS:-}"
    assert env["MAEC_METRICS_TOKEN_SHA256"] == "${MAEC_METRICS_TOKEN_SHA256:-}"
    assert "MAEC_METRICS_TOKEN_SHA256" not in compose["services"]["worker"]["environment"]
