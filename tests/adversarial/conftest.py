"""The adversarial suite: hostile clients and faults against real processes on 127.0.0.1.

It uses the integration suite's launchers (real sim, real gateway under the CLI)."""

from tests.integration.conftest import (  # noqa: F401 (fixtures)
    launcher,
    module_launcher,
    start_gateway,
    start_sim,
)
