"""The kustomize base renders offline, validates against Kubernetes' schemas, and is wired
together the way the controller and the launcher expect."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.support import kustomize

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "deploy" / "kubernetes" / "base"
SCHEMAS = Path(__file__).parent / "schemas"
K8S_VERSIONS = ("1.29", "1.33")  # the oldest with native sidecars GA-ish, and a recent one


@pytest.fixture(scope="module")
def docs() -> list[dict[str, Any]]:
    return kustomize.render(BASE)


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def container(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == name)


def configmap(docs: list[dict[str, Any]], prefix: str) -> dict[str, Any]:
    # kustomize appends a content hash to generated names.
    return next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith(prefix))


def test_renders_the_expected_objects(docs) -> None:
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        ["ConfigMap", "ConfigMap", "Secret", "Deployment", "Service", "PodDisruptionBudget",
         "PodMonitor"]
    )  # fmt: skip
    for d in docs:
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "sd-controller"


@pytest.mark.skipif(kustomize.kubectl_binary() is None, reason="kubectl not installed")
def test_python_fallback_renders_what_kubectl_renders() -> None:
    def normalise(docs: list[dict[str, Any]]) -> str:
        text = json.dumps(sorted(docs, key=lambda d: (d["kind"], d["metadata"]["name"])),
                          sort_keys=True)  # fmt: skip
        return re.sub(r"(sd-controller-(settings|calibration))-[a-z0-9]{10}", r"\1", text)

    assert normalise(kustomize.render_in_python(BASE)) == normalise(kustomize.render_with_kubectl(BASE))


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_objects_validate_against_kubernetes_schemas(docs, version: str) -> None:
    import kubernetes_validate as kv  # a dev dependency: an ImportError is a setup bug, not a skip

    builtin = [d for d in docs if not d["apiVersion"].startswith("monitoring.coreos.com")]
    assert len(builtin) == 6
    for doc in builtin:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} (k8s {version}): {e}")


def test_podmonitor_validates_against_its_crd_schema(docs) -> None:
    schema = json.loads((SCHEMAS / "podmonitor-monitoring-v1.json").read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    jsonschema.validate(one(docs, "PodMonitor"), schema)
    # The schema does bite: a typo'd key is rejected.
    bad = json.loads(json.dumps(one(docs, "PodMonitor")))
    bad["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def test_vllm_runs_under_the_launcher(docs) -> None:
    vllm = container(docs, "vllm")
    cmd = vllm["command"] + vllm.get("args", [])
    assert cmd[:2] == ["sd-controller", "launch"]
    sep = cmd.index("--")
    assert cmd[sep + 1 : sep + 4] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    vllm_argv = cmd[sep + 1 :]
    assert "--port=8000" in vllm_argv
    spec = next(a for a in vllm_argv if a.startswith("--speculative-config="))
    config = json.loads(spec.split("=", 1)[1])
    assert config["num_speculative_tokens"] >= 1
    env = {e["name"]: e for e in vllm["env"]}
    assert env["SD_LAUNCHER_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "sd-admin-token"


def launcher_option(docs, name: str) -> str:
    vllm = container(docs, "vllm")
    cmd = vllm["command"]
    launcher_part = cmd[: cmd.index("--")]
    return next(a.split("=", 1)[1] for a in launcher_part if a.startswith(f"{name}="))


def test_grace_period_exceeds_the_launchers_drain(docs) -> None:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    drain_s = float(launcher_option(docs, "--drain-s"))
    assert pod["terminationGracePeriodSeconds"] >= drain_s + 30


def test_probes_tolerate_a_restart_in_progress(docs) -> None:
    vllm = container(docs, "vllm")
    # Liveness and startup watch the launcher, which stays up while vLLM restarts ...
    for probe in ("livenessProbe", "startupProbe"):
        text = json.dumps(vllm[probe])
        assert "127.0.0.1:8091/healthz" in text, probe
        assert "/health'" not in text and '"/health"' not in text, probe
    # ... readiness watches vLLM itself, so the router stops sending to a restarting replica.
    assert vllm["readinessProbe"]["httpGet"]["path"] == "/health"
    assert vllm["readinessProbe"]["httpGet"]["port"] == "http"
    # A liveness budget shorter than a restart would kill every toggle: the launcher probe has
    # no such limit, but keep it generous anyway.
    live = vllm["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 60


def test_every_container_has_requests_limits_and_probes(docs) -> None:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    for c in pod["containers"]:
        assert c["resources"]["requests"], c["name"]
        assert c["resources"]["limits"].get("memory"), c["name"]
        assert "readinessProbe" in c and "livenessProbe" in c, c["name"]
        assert c["securityContext"]["allowPrivilegeEscalation"] is False, c["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container(docs, "vllm")["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_controller_settings_point_at_what_the_pod_provides(docs) -> None:
    ctl = container(docs, "sd-controller")
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    settings_name = ctl["envFrom"][0]["configMapRef"]["name"]
    settings = next(d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == settings_name)
    data = settings["data"]
    assert all(k.startswith("SD_CONTROLLER_") for k in data)
    assert data["SD_CONTROLLER_HOOK_TYPE"] == "launcher"
    assert data["SD_CONTROLLER_HOOK_URL"] == "http://127.0.0.1:8091"
    assert data["SD_CONTROLLER_VLLM_METRICS_URL"] == "http://127.0.0.1:8000/metrics"
    assert data["SD_CONTROLLER_OVERRIDE"] in ("auto", "on", "off")

    mounts = {m["mountPath"]: m for m in ctl["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}

    def volume_for(path: str) -> dict[str, Any]:
        parent = str(Path(path).parent)
        assert parent in mounts, f"{path}: no volume mounted at {parent}"
        return volumes[mounts[parent]["name"]]

    token = volume_for(data["SD_CONTROLLER_HOOK_TOKEN_FILE"])
    assert token["secret"]["secretName"] == "sd-admin-token"
    assert [i["path"] for i in token["secret"]["items"]] == [Path(data["SD_CONTROLLER_HOOK_TOKEN_FILE"]).name]
    calibration = volume_for(data["SD_CONTROLLER_CALIBRATION_FILE"])
    cal_map = next(
        d for d in by_kind(docs, "ConfigMap")
        if d["metadata"]["name"] == calibration["configMap"]["name"]
    )  # fmt: skip
    assert Path(data["SD_CONTROLLER_CALIBRATION_FILE"]).name in cal_map["data"]
    state = volume_for(data["SD_CONTROLLER_STATE_FILE"])
    assert "emptyDir" in state  # writable, survives a container restart
    assert not mounts[str(Path(data["SD_CONTROLLER_STATE_FILE"]).parent)].get("readOnly")

    port = int(data["SD_CONTROLLER_EXPORTER_PORT"])
    assert {"name": "sd-metrics", "containerPort": port, "protocol": "TCP"} in ctl["ports"]
    assert ctl["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "sd-metrics"}


def test_settings_load_in_the_controller(docs, monkeypatch) -> None:
    """The ConfigMap, as the sidecar's environment, is a valid Settings for the controller."""
    import controller.settings as settings_mod

    for name in [k for k in os.environ if k.startswith(settings_mod.ENV_PREFIX)]:
        monkeypatch.delenv(name)
    data = configmap(docs, "sd-controller-settings")["data"]
    known = {f"{settings_mod.ENV_PREFIX}{name.upper()}" for name in settings_mod.Settings.model_fields}
    assert set(data) <= known, f"unknown settings: {sorted(set(data) - known)}"
    for key, value in data.items():
        monkeypatch.setenv(key, value)
    settings = settings_mod.load_settings()
    assert settings.hook_type.value == "launcher"
    assert settings.exporter_port == 9464
    assert str(settings.state_file) == "/var/lib/sd-controller/state.json"


def test_calibration_in_the_configmap_is_a_valid_calibration_file(docs) -> None:
    import controller.calibration as calibration

    text = configmap(docs, "sd-controller-calibration")["data"]["calibration.json"]
    calibration.parse(text, where="deploy/kubernetes/base/calibration.json")


def test_settings_agree_with_the_pod(docs) -> None:
    """Values that live in two places (settings.env and the pod spec) must agree."""
    data = configmap(docs, "sd-controller-settings")["data"]
    vllm = container(docs, "vllm")
    argv = vllm["command"] + vllm["args"]
    env = {e["name"]: e.get("value") for e in vllm["env"]}
    spec = json.loads(next(a for a in argv if a.startswith("--speculative-config=")).split("=", 1)[1])
    assert int(data["SD_CONTROLLER_DRAFT_LENGTH"]) == spec["num_speculative_tokens"]
    assert int(data["SD_CONTROLLER_REPLICAS"]) == one(docs, "Deployment")["spec"]["replicas"]
    served = next(a for a in argv if a.startswith("--served-model-name=")).split("=", 1)[1]
    assert served.replace("$(SERVED_MODEL_NAME)", env["SERVED_MODEL_NAME"]) == data["SD_CONTROLLER_VLLM_MODEL_NAME"]
    # A switch the launcher may still complete (drain + start-up) is not declared failed.
    budget = float(launcher_option(docs, "--drain-s")) + float(launcher_option(docs, "--ready-timeout-s"))
    assert float(data["SD_CONTROLLER_PENDING_TIMEOUT_S"]) > budget


def test_service_pdb_and_podmonitor_select_the_pods(docs) -> None:
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    deployment_selector = one(docs, "Deployment")["spec"]["selector"]["matchLabels"]
    assert deployment_selector.items() <= pod_labels.items()
    assert one(docs, "Service")["spec"]["selector"].items() <= pod_labels.items()
    pdb = one(docs, "PodDisruptionBudget")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()
    monitor = one(docs, "PodMonitor")["spec"]
    assert monitor["selector"]["matchLabels"].items() <= pod_labels.items()

    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    port_names = {p["name"] for c in pod["containers"] for p in c.get("ports", [])}
    scraped = {e["port"] for e in monitor["podMetricsEndpoints"]}
    assert scraped == {"http", "sd-metrics"}
    assert scraped <= port_names
    for port in one(docs, "Service")["spec"]["ports"]:
        assert port["targetPort"] in port_names


def test_at_least_two_replicas_and_one_at_a_time(docs) -> None:
    spec = one(docs, "Deployment")["spec"]
    assert spec["replicas"] >= 2
    assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    assert one(docs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1


def test_secret_token_is_referenced_not_inlined_in_the_pod(docs) -> None:
    pod_text = yaml.safe_dump(one(docs, "Deployment"))
    token = one(docs, "Secret")["stringData"]["token"]
    assert token not in pod_text


@pytest.mark.skipif(kustomize.kubectl_binary() is None, reason="kubectl not installed")
def test_the_overlay_in_the_deployment_guide_renders(tmp_path: Path) -> None:
    guide = (ROOT / "docs" / "deployment.md").read_text()
    overlay_text = re.search(r"cat > kustomization.yaml <<'EOF'\n(.*?)\nEOF", guide, re.S)
    assert overlay_text, "no overlay example in docs/deployment.md"
    (tmp_path / "base").symlink_to(BASE)
    overlay = tmp_path / "overlays" / "prod"
    overlay.mkdir(parents=True)
    (overlay / "kustomization.yaml").write_text(overlay_text.group(1))
    (overlay / "calibration.json").write_text((BASE / "calibration.json").read_text())
    docs = kustomize.render_with_kubectl(overlay)
    images = {c["image"] for c in one(docs, "Deployment")["spec"]["template"]["spec"]["containers"]}
    assert images == {"ghcr.io/you/sd-controller:0.1.0", "ghcr.io/you/vllm-sd-launcher:0.1.0"}
    secret = one(docs, "Secret")
    assert "stringData" not in secret and secret["data"]["token"]  # replaced, base64
    assert len(by_kind(docs, "ConfigMap")) == 2
