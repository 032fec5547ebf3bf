"""The command line's own options: --version, and --log-level on either side of the subcommand."""

import subprocess
import sys
from importlib import metadata

import pytest

from gateway.programs.cli import _parser


def test_version_names_the_installed_package():
    run = subprocess.run(
        [sys.executable, "-m", "gateway", "--version"], capture_output=True, text=True, timeout=60
    )
    assert (run.returncode, run.stdout.strip()) == (
        0,
        f"inference-gateway {metadata.version('inference-gateway')}",
    )


@pytest.mark.parametrize(
    ("argv", "level"),
    [
        (["serve", "--config", "x.yaml"], "info"),
        (["--log-level", "debug", "serve", "--config", "x.yaml"], "debug"),
        (["serve", "--config", "x.yaml", "--log-level", "warning"], "warning"),
        (["simulate", "--rate", "10", "--log-level", "error"], "error"),
    ],
)
def test_the_log_level_is_taken_before_or_after_the_subcommand(argv, level):
    assert _parser().parse_args(argv).log_level == level
