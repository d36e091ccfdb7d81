"""Render a kustomize directory offline: ``kubectl kustomize`` when kubectl is installed,
else a small pure-Python renderer for the subset our base uses.

The fallback supports ``resources`` (files), ``configMapGenerator`` (``envs``, ``files``,
``literals``; no name hash) and ``labels`` (``pairs`` on metadata). Anything else in the
kustomization raises, so the fallback can never silently render something different.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "configMapGenerator", "labels"}


def kubectl_binary() -> str | None:
    return shutil.which("kubectl")


def render_with_kubectl(directory: Path) -> list[dict[str, Any]]:
    binary = kubectl_binary()
    if binary is None:
        raise FileNotFoundError("kubectl not on PATH")
    out = subprocess.run(
        [binary, "kustomize", str(directory)], check=True, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def render_in_python(directory: Path) -> list[dict[str, Any]]:
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kust) - SUPPORTED_KEYS
    if unknown:
        raise NotImplementedError(f"fallback kustomize: unsupported keys {sorted(unknown)}")
    docs: list[dict[str, Any]] = []
    for gen in kust.get("configMapGenerator", []):
        data: dict[str, str] = {}
        for env_file in gen.get("envs", []):
            for line in (directory / env_file).read_text().splitlines():
                line = line.strip()
                if line and not line.startswith("#"):
                    key, _, value = line.partition("=")
                    data[key] = value
        for spec in gen.get("files", []):
            key, _, path = spec.partition("=")
            path = path or key
            data[Path(key).name] = (directory / path).read_text()
        for literal in gen.get("literals", []):
            key, _, value = literal.partition("=")
            data[key] = value
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": gen["name"]},
                "data": data,
            }
        )
    for resource in kust.get("resources", []):
        docs.extend(d for d in yaml.safe_load_all((directory / resource).read_text()) if d)
    docs = copy.deepcopy(docs)
    for label in kust.get("labels", []):
        pairs = label.get("pairs", {})
        for doc in docs:
            doc.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
            if label.get("includeSelectors"):
                raise NotImplementedError("fallback kustomize: labels.includeSelectors")
    return docs


def render(directory: Path) -> list[dict[str, Any]]:
    """The rendered manifests of ``directory`` (kubectl if available, else the fallback)."""
    if kubectl_binary():
        return render_with_kubectl(directory)
    return render_in_python(directory)
