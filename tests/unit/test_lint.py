"""The code stays ruff-clean, and policies/ and gateway/ type-check under mypy --strict."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_ruff_is_clean():
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "."], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_policies_and_the_gateway_type_check_strictly():
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--no-error-summary"], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
