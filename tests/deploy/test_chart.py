"""The Helm chart (deploy/helm/maec), checked without a cluster.

Helm's own Go SDK (the helm-python-sdk wheel) renders it, as ``helm template`` would;
every manifest is then checked against the Kubernetes schemas that kubernetes-validate
ships (strict: an unknown field is an error), and KEDA's objects, which those schemas do
not cover, against the KEDA schemas committed in deploy/schemas/keda/.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from app.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "maec"
KEDA_SCHEMAS = ROOT / "deploy" / "schemas" / "keda"
CI_VALUES: dict[str, Any] = yaml.safe_load((CHART / "ci" / "test-values.yaml").read_text())
# The chart's floor (Chart.yaml kubeVersion) and the newest schemas shipped.
KUBE_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
SECRET_ENV = {"MAEC_API_KEYS", "MAEC_S3_ACCESS_KEY", "MAEC_S3_SECRET_KEY",
              "MAEC_WEBHOOK_SECRETS", "MAEC_REDIS_PASSWORD", "FLOWER_BASIC_AUTH",
              "MAEC_METRICS_TOKEN_SHA256"}


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    with helm.Chart.load(str(CHART)) as chart:
        files = chart.render(values, name="maec", namespace="ml")
    docs = [d for text in files.values() for d in yaml.safe_load_all(text) if d]
    assert docs, "the chart rendered nothing"
    return docs


def external_redis() -> dict[str, Any]:
    values = copy.deepcopy(CI_VALUES)
    values["redis"] = {"enabled": False, "external": {
        "host": "redis.data.svc", "port": 6380, "db": 2, "tls": True,
        "existingSecret": "maec-redis", "passwordKey": "password"}}
    # KEDA reads the Celery queues from Redis itself: the password goes to it too.
    values["autoscaling"]["queued"] = {"source": "celery"}
    return values


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return render(CI_VALUES)


def of_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workers(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["labels"]["maec.pool"]: d
            for d in of_kind(docs, "Deployment").values() if "maec.pool" in d["metadata"]["labels"]}


def env_of(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def keda_validator(kind: str) -> jsonschema.Draft7Validator:
    schema = json.loads((KEDA_SCHEMAS / f"{kind.lower()}-keda-v1alpha1.json").read_text())
    return jsonschema.Draft7Validator(schema)


def validate(doc: dict[str, Any], version: str) -> None:
    if doc["apiVersion"].startswith("keda.sh/"):
        keda_validator(doc["kind"]).validate(doc)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("variant", ["in-release redis", "external redis"])
@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_manifest_is_valid(variant: str, version: str) -> None:
    docs = render(CI_VALUES if variant == "in-release redis" else external_redis())
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "ScaledObject"} <= kinds
    for doc in docs:
        validate(doc, version)


def test_the_keda_schema_refuses_what_keda_would() -> None:
    """The committed schema is no rubber stamp: a number where KEDA wants a string,
    a misspelt field, and a ScaledObject without triggers are all refused."""
    so = next(d for d in render(CI_VALUES) if d["kind"] == "ScaledObject")
    check = keda_validator("ScaledObject")
    check.validate(so)
    bad = copy.deepcopy(so)
    bad["spec"]["triggers"][0]["metadata"]["threshold"] = 1
    typo = copy.deepcopy(so)
    typo["spec"]["minReplicas"] = 0
    empty = copy.deepcopy(so)
    empty["spec"]["triggers"] = []
    for wrong in (bad, typo, empty):
        assert not check.is_valid(wrong)


def test_a_deployment_kubernetes_would_refuse_is_caught() -> None:
    """kubernetes-validate really checks: a misspelt container field fails."""
    api = next(d for d in render(CI_VALUES) if d["kind"] == "Deployment")
    api["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(api, KUBE_VERSIONS[-1], strict=True)


def test_one_worker_deployment_and_scaled_object_per_pool(docs: list[dict[str, Any]]) -> None:
    pools = {p["name"]: p for p in CI_VALUES["pools"]}
    deployed = workers(docs)
    assert set(deployed) == set(pools)
    scaled = {d["spec"]["scaleTargetRef"]["name"]: d for d in docs
              if d["kind"] == "ScaledObject"}
    for name, pool in pools.items():
        dep = deployed[name]
        assert dep["metadata"]["name"] in scaled
        assert "replicas" not in dep["spec"], "KEDA owns the replica count"
        pod = dep["spec"]["template"]["spec"]
        (worker,) = pod["containers"]
        cmd = worker["command"]
        assert cmd[:4] == ["celery", "-A", "worker.celery_app", "worker"]
        assert cmd[cmd.index("-Q") + 1] == pool.get("queue", name)
        env = env_of(worker)
        assert env["MAEC_WORKER_POOL"]["value"] == name
        gpus = pool["gpus"]
        res = worker["resources"]
        if gpus:
            assert res["limits"]["nvidia.com/gpu"] == gpus == res["requests"]["nvidia.com/gpu"]
        else:
            assert "nvidia.com/gpu" not in res.get("limits", {})
        assert pod.get("nodeSelector", {}) == pool.get("nodeSelector", {})
        assert pod.get("tolerations", []) == pool.get("tolerations", [])


def test_every_pod_knows_every_pool_and_its_capacity(docs: list[dict[str, Any]]) -> None:
    """MAEC_POOLS (the API routes by it, a worker checks its own pool against it) is the
    same in every API and worker pod, each pool's capacity in the settings' GiB fields."""
    fields = {"hostMemoryGib": "host_memory_gib", "gpuMemoryGib": "gpu_memory_gib",
              "diskGib": "disk_gib"}
    want = {p["name"]: {fields[k]: v for k, v in p["capacity"].items()}
            for p in CI_VALUES["pools"]}
    pods = [d for d in of_kind(docs, "Deployment").values()
            if d["metadata"]["labels"]["app.kubernetes.io/component"] in ("api", "worker")]
    assert len(pods) == 1 + len(want)
    for dep in pods:
        env = env_of(dep["spec"]["template"]["spec"]["containers"][0])
        assert json.loads(env["MAEC_POOLS"]["value"]) == want
        if "pools" in Settings.model_fields:
            # The service's own settings accept what the chart writes, the worker's pool
            # included.
            Settings.model_validate({
                "dev_mode": True, "pools": json.loads(env["MAEC_POOLS"]["value"]),
                "worker_pool": env.get("MAEC_WORKER_POOL", {}).get("value")})


def test_termination_grace_covers_the_longest_stage(docs: list[dict[str, Any]]) -> None:
    """A pod's grace outlasts its merge's hard time limit plus the drain margin (the
    publish and status write after it), and the worker runs with that very limit."""
    chart_defaults = yaml.safe_load((CHART / "values.yaml").read_text())["worker"]
    # The chart's default limit is the service's own.
    assert chart_defaults["taskTimeLimitSeconds"] == Settings.model_fields[
        "task_time_limit"].default
    margin = chart_defaults["drainMarginSeconds"]
    for pool in CI_VALUES["pools"]:
        pod = workers(docs)[pool["name"]]["spec"]["template"]["spec"]
        limit = pool.get("taskTimeLimitSeconds", chart_defaults["taskTimeLimitSeconds"])
        assert int(env_of(pod["containers"][0])["MAEC_TASK_TIME_LIMIT"]["value"]) == limit
        # The soft limit (a minute under) cleans up; the margin covers publishing.
        assert pod["terminationGracePeriodSeconds"] >= limit + margin
        assert margin >= 120


@pytest.mark.parametrize("source", ["prometheus", "celery"])
def test_scaling_counts_queued_plus_running(source: str) -> None:
    docs = render(CI_VALUES if source == "prometheus" else external_redis())
    pools = {p["name"]: p for p in CI_VALUES["pools"]}
    scaled = of_kind(docs, "ScaledObject")
    assert len(scaled) == len(pools)
    for so in scaled.values():
        pool = pools[so["metadata"]["labels"]["maec.pool"]]
        assert so["spec"]["minReplicaCount"] == pool.get("minReplicas", 0)
        assert so["spec"]["maxReplicaCount"] == pool["maxReplicas"]
        triggers = {t["name"]: t for t in so["spec"]["triggers"]}
        queued = triggers["queued"]
        if source == "celery":
            assert queued["type"] == "redis"
            assert queued["metadata"]["listName"] == pool.get("queue", pool["name"])
        else:
            assert queued["type"] == "prometheus"
            assert queued["metadata"]["query"] == \
                f'sum(maec_pool_queued{{pool="{pool["name"]}"}}) or vector(0)'
        assert triggers["active"]["type"] == "prometheus"
        assert triggers["active"]["metadata"]["query"] == \
            f'sum(maec_pool_active{{pool="{pool["name"]}"}}) or vector(0)'
        assert so["spec"]["advanced"]["scalingModifiers"]["formula"] == "queued + active"


def test_secrets_only_from_secret_objects() -> None:
    """Every credential reaches a pod as a secretKeyRef; no value in the chart's values
    or the rendered manifests holds one; values naming a credential are refused."""
    for values in (CI_VALUES, external_redis()):
        docs = render(values)
        assert not of_kind(docs, "Secret"), "the chart creates no Secret of its own"
        for dep in of_kind(docs, "Deployment").values():
            for c in dep["spec"]["template"]["spec"]["containers"]:
                for name, e in env_of(c).items():
                    if name in SECRET_ENV:
                        assert set(e) == {"name", "valueFrom"}, name
                        assert "secretKeyRef" in e["valueFrom"], name
        for so in of_kind(docs, "TriggerAuthentication").values():
            assert so["spec"]["secretTargetRef"][0]["name"] == "maec-redis"
    for where, leak in ((("s3",), {"accessKey": "AKIAEXAMPLE"}),
                        (("auth",), {"apiKeys": '{"a": "b"}'}),
                        (("settings", "extraEnv"), {"MAEC_S3_SECRET_KEY": "x"}),
                        (("redis", "external"), {"password": "x"})):
        values = copy.deepcopy(CI_VALUES)
        node = values
        for part in where:
            node = node.setdefault(part, {})
        node.update(leak)
        with pytest.raises(helm.HelmError, match="schema"):
            render(values)


def test_missing_secret_names_are_named() -> None:
    values = copy.deepcopy(CI_VALUES)
    del values["auth"]
    with pytest.raises(helm.HelmError, match=r"auth\.existingSecret"):
        render(values)


def test_external_redis_password_never_rendered() -> None:
    docs = render(external_redis())
    api = next(d for d in of_kind(docs, "Deployment").values()
               if d["metadata"]["labels"]["app.kubernetes.io/component"] == "api")
    env = env_of(api["spec"]["template"]["spec"]["containers"][0])
    names = [e["name"] for e in api["spec"]["template"]["spec"]["containers"][0]["env"]]
    # Kubernetes expands $(VAR) only from variables defined before it.
    assert names.index("MAEC_REDIS_PASSWORD") < names.index("MAEC_REDIS_URL")
    assert env["MAEC_REDIS_URL"]["value"] == \
        "rediss://:$(MAEC_REDIS_PASSWORD)@redis.data.svc:6380/2"
    assert not of_kind(docs, "StatefulSet")
    so = next(iter(of_kind(docs, "ScaledObject").values()))
    queued = next(t for t in so["spec"]["triggers"] if t["name"] == "queued")
    assert queued["metadata"]["address"] == "redis.data.svc:6380"
    assert queued["metadata"]["enableTLS"] == "true"
    assert queued["authenticationRef"]["name"] in of_kind(docs, "TriggerAuthentication")


def test_api_probes_and_redis_config(docs: list[dict[str, Any]]) -> None:
    api = next(d for d in of_kind(docs, "Deployment").values()
               if d["metadata"]["labels"]["app.kubernetes.io/component"] == "api")
    (c,) = api["spec"]["template"]["spec"]["containers"]
    routes = (ROOT / "app" / "api" / "routes" / "health.py").read_text()
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        path = c[probe]["httpGet"]["path"]
        assert f'@router.get("{path}"' in routes, path
    # The in-release Redis runs the repository's own configuration.
    assert (CHART / "files" / "redis.conf").read_text() == \
        (ROOT / "deploy" / "redis.conf").read_text()
    cm = next(iter(of_kind(docs, "ConfigMap").values()))
    assert "maxmemory-policy noeviction" in cm["data"]["redis.conf"]
    assert "appendonly yes" in cm["data"]["redis.conf"]
    flower = next(d for d in of_kind(docs, "Deployment").values()
                  if d["metadata"]["labels"]["app.kubernetes.io/component"] == "flower")
    assert flower["spec"]["template"]["spec"]["containers"][0]["command"][:2] == [
        "celery", "--broker=$(MAEC_REDIS_URL)"]


def test_chart_lints_clean() -> None:
    report = helm.lint(str(CHART), values=CI_VALUES)
    assert not report["errors"], report
    assert not [m for m in report["messages"] if m["severity"] > 1], report


def _api_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    api = next(d for d in of_kind(docs, "Deployment").values()
               if d["metadata"]["labels"]["app.kubernetes.io/component"] == "api")
    (c,) = api["spec"]["template"]["spec"]["containers"]
    return dict(c)


def test_proxy_headers_are_believed_only_from_the_ingress(docs: list[dict[str, Any]]
                                                          ) -> None:
    """uvicorn's own default trusts X-Forwarded-For from 127.0.0.1: the chart always
    sets FORWARDED_ALLOW_IPS, to the ingress the values name, else to nobody."""
    c = _api_container(docs)
    assert "--proxy-headers" in c["command"]
    assert not any(a.startswith("--forwarded-allow-ips") for a in c["command"])
    assert env_of(c)["FORWARDED_ALLOW_IPS"]["value"] == CI_VALUES["api"]["forwardedAllowIps"]
    values = copy.deepcopy(CI_VALUES)
    del values["api"]["forwardedAllowIps"]
    assert env_of(_api_container(render(values)))["FORWARDED_ALLOW_IPS"]["value"] == ""
    values["api"]["forwardedAllowIps"] = "*"  # everyone could pick their address
    with pytest.raises(helm.HelmError, match="schema"):
        render(values)


def test_metrics_token_comes_from_the_secret_and_per_key_is_off(
        docs: list[dict[str, Any]]) -> None:
    env = env_of(_api_container(docs))
    ref = env["MAEC_METRICS_TOKEN_SHA256"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": CI_VALUES["auth"]["existingSecret"],
                   "key": CI_VALUES["auth"]["metricsTokenKey"]}
    assert env["MAEC_METRICS_PER_KEY"]["value"] == "false"
    for dep in of_kind(docs, "Deployment").values():  # the workers do not serve /metrics
        if dep["metadata"]["labels"]["app.kubernetes.io/component"] != "api":
            for c in dep["spec"]["template"]["spec"]["containers"]:
                assert "MAEC_METRICS_TOKEN_SHA256" not in env_of(c)
