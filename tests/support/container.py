"""Build the controller image for real with Debian's buildah, from a base of Debian packages.

No registry is involved: ``mmdebstrap`` makes a bookworm root file system with python3 and
pip (Debian's packages), ``buildah`` turns it into the ``PYTHON_IMAGE`` the Dockerfile takes
as a build argument, builds the ``controller`` target and runs commands in the result.
``--isolation chroot`` because OCI runtimes need cgroup controllers a CI container may not
delegate; the host's CA bundle is mounted into the build's RUN steps only (a TLS-inspecting
proxy in front of PyPI), never copied into the image.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

BASE_IMAGE = "localhost/sd-debian-python:bookworm"
IMAGE = "localhost/sd-controller:test"
PACKAGES = "python3,python3-pip,python3-venv,ca-certificates"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
ISOLATION = ["--isolation", "chroot"]


def tools_missing() -> list[str]:
    return [tool for tool in ("buildah", "mmdebstrap") if shutil.which(tool) is None]


def _run(argv: list[str], timeout_s: float, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, check=False, **kw)


def _check(proc: subprocess.CompletedProcess, what: str) -> str:
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
        raise AssertionError(f"{what} failed (exit {proc.returncode}):\n{tail}")
    return proc.stdout


def image_exists(name: str) -> bool:
    return _run(["buildah", "inspect", "--type", "image", name], 60).returncode == 0


def build_base(workdir: Path, timeout_s: float = 600) -> None:
    """The Debian-packages base image, unless it is already in local storage."""
    if image_exists(BASE_IMAGE):
        return
    rootfs = workdir / "rootfs.tar"
    _check(
        _run(
            ["mmdebstrap", "--variant=minbase", f"--include={PACKAGES}", "--mode=root", "bookworm", str(rootfs),
             "http://deb.debian.org/debian"],
            timeout_s,
        ),
        "mmdebstrap",
    )  # fmt: skip
    ctr = _check(_run(["buildah", "from", "scratch"], 60), "buildah from scratch").strip()
    try:
        _check(_run(["buildah", "add", ctr, str(rootfs), "/"], 300), "buildah add")
        _check(_run(["buildah", "commit", "-q", ctr, BASE_IMAGE], 300), "buildah commit")
    finally:
        _run(["buildah", "rm", ctr], 60)
        rootfs.unlink(missing_ok=True)


def build_image(context: Path, timeout_s: float = 900) -> None:
    volumes = ["-v", f"{CA_BUNDLE}:{CA_BUNDLE}:ro"] if CA_BUNDLE.exists() else []
    _check(
        _run(
            ["buildah", "bud", *ISOLATION, "--network", "host", "--layers=false", "--target", "controller",
             *volumes, "--build-arg", f"PYTHON_IMAGE={BASE_IMAGE}", "-t", IMAGE, str(context)],
            timeout_s,
        ),
        "buildah bud",
    )  # fmt: skip


class Container:
    """A working container of IMAGE; ``run`` executes a command in it on the host network."""

    def __enter__(self) -> Container:
        self.name = _check(_run(["buildah", "from", IMAGE], 120), "buildah from").strip()
        return self

    def run(self, argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 120):
        envs = [f"--env={k}={v}" for k, v in (env or {}).items()]
        return _run(["buildah", "run", *ISOLATION, "--network", "host", *envs, self.name, "--", *argv], timeout_s)

    def __exit__(self, *exc: object) -> None:
        _run(["buildah", "rm", self.name], 60)
