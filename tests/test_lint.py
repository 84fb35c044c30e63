"""The code passes the linter's checks chosen in pyproject.toml ([tool.ruff.lint]): errors, unused or undefined
names, import order and likely bugs, in the package, tests, examples and benchmarks; and the package is laid out as
``ruff format`` lays it out (tests and benchmarks keep hand-aligned tables of cases)."""

import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The version the test extra pins: another release may check differently.
RUFF = "0.17.6"


def ruff(*arguments: str) -> subprocess.CompletedProcess:
    """``ruff arguments`` at the repository's root, with the pinned version (skipped with another)."""
    try:
        version = importlib.metadata.version("ruff")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("ruff is not installed: pip install -e '.[test]'")
    if version != RUFF:
        pytest.skip(f"ruff {version} is installed; the checks are kept for ruff {RUFF}: pip install ruff=={RUFF}")
    command = [sys.executable, "-m", "ruff", *arguments]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)


def test_the_code_passes_ruff():
    result = ruff("check", "--no-cache", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_the_package_is_formatted():
    result = ruff("format", "--no-cache", "--check", "targetpo")
    assert result.returncode == 0, "run `ruff format targetpo`:\n" + result.stdout[-4000:] + result.stderr[-2000:]
