"""The docs: the site builds with mkdocs --strict (every link and anchor resolves), the generated
reference pages say what the code does, and the README stays short and keeps its two commands."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gateway.settings import Settings
from gateway.tools.reference import cli_page, metrics_page

ROOT = Path(__file__).parents[2]
INSTALL_AND_RUN = "python3 -m pip install . && python3 -m gateway demo"
TEST = "python3 -m pip install -e '.[test]' && python3 -m pytest"


@pytest.mark.parametrize(("page", "generated"), [("metrics.md", metrics_page), ("cli.md", cli_page)])
def test_the_generated_reference_pages_are_current(page, generated):
    written = (ROOT / "docs" / "reference" / page).read_text()
    renew = f"python -m gateway.tools.reference {page.removesuffix('.md')} > docs/reference/{page}"
    assert written == generated(), f"docs/reference/{page} is stale: {renew}"


def test_the_docs_site_builds_strictly(tmp_path):
    mkdocs = shutil.which("mkdocs")
    assert mkdocs is not None, "mkdocs-material is in the test extras: pip install -e '.[test]'"
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert built.returncode == 0, built.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "reference" / "metrics" / "index.html").is_file()


def test_the_readme_is_short_and_its_quickstart_has_the_two_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 160
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```sh\n(.*?)\n```", quickstart, re.DOTALL)
    assert commands == [INSTALL_AND_RUN, TEST]
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith(TEST)


def test_the_readmes_config_is_one_the_gateway_takes():
    readme = (ROOT / "README.md").read_text()
    (config,) = re.findall(r"```yaml\n(.*?)```", readme, re.DOTALL)
    Settings.model_validate(yaml.safe_load(config))
