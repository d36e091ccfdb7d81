"""Scripts and container commands run on stock Debian: `python3`, never a bare `python`."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FILES = ["scripts/test.sh", "scripts/setup-vllm.sh", ".ci/run", "Dockerfile", "deploy/compose/docker-compose.yml"]
# `python` as a command word: at a line start, after a shell separator or as a JSON argv item.
BARE = re.compile(r"""(^|[;&|(]\s*|\bexec\s+|\["|"CMD",\s*")python(["\s]|$)""")


@pytest.mark.parametrize("name", FILES)
def test_no_bare_python(name):
    lines = (ROOT / name).read_text().splitlines()
    bad = [
        f"{name}:{i}: {line.strip()}"
        for i, line in enumerate(lines, 1)
        if not line.lstrip().startswith("#") and BARE.search(line.strip())
    ]
    assert not bad, bad


def test_readme_mentions_the_torch_wheels_setting():
    assert "SD_TORCH_WHEELS" in (ROOT / "README.md").read_text()
