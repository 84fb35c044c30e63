"""The code passes the linter's checks chosen in pyproject.toml ([tool.ruff.lint]): errors, unused or undefined
names, import order and likely bugs, in the package, tests, examples and benchmarks."""

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_code_passes_ruff():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed: pip install -e '.[test]'")
    result = subprocess.run([ruff, "check", "--output-format", "concise", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
