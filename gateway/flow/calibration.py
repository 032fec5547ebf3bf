"""Each flow's admission confidence, kept as state and steered by policies.calibration.

A flow is a (model, band, tenant): the flows of one band share a pool but not their errors. Under
fair queuing a tenant of costly requests waits for its turn behind the others' work, and its
predicted waits err more than theirs; calibrated per band, the many cheap requests that were
served in time loosened the margin for all, and the costly tenant's admitted requests expired ten
times as often as the target (with 8-item batches against single items, weighted 1:3: 10% of its
admitted requests expired where the band as a whole stayed under 1%). Each flow now keeps its own;
a flow not seen yet starts from its band's, which every outcome in the band steers, and which is
what the metric shows. Flows are the configured tenants' and one for the rest, so they are bounded.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.telemetry.metrics import GatewayMetrics
from policies.calibration import CalibrationConfig, confidence_after, starting_confidence


class Calibrations:
    """The confidence admission asks of each flow, from `safety_sigmas` at first, then moved by
    every admitted request of the flow that queued: served in time, or expired in the queue."""

    def __init__(
        self,
        class_names: Sequence[str],
        config: CalibrationConfig,
        safety_sigmas: float,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self._class_names = list(class_names)
        self._config = config
        self._start = starting_confidence(safety_sigmas, config)
        self._metrics = metrics
        self._by_band: dict[tuple[str, int], float] = {}
        self._by_flow: dict[tuple[str, int, str], float] = {}

    def confidence(self, model: str, band: int, tenant: str) -> float:
        """The confidence a request of the flow (`tenant`: its flow's, "" for no configured one) is
        admitted at."""
        found = self._by_flow.get((model, band, tenant))
        return self.band_confidence(model, band) if found is None else found

    def band_confidence(self, model: str, band: int) -> float:
        return self._by_band.get((model, band), self._start)

    def settled(self, model: str, band: int, tenant: str, expired: bool) -> None:
        """An admitted request of the flow that waited in the queue left it: `expired`, or with its slot."""
        flow = (model, band, tenant)
        self._by_flow[flow] = confidence_after(self.confidence(model, band, tenant), expired, self._config)
        band_wide = confidence_after(self.band_confidence(model, band), expired, self._config)
        self._by_band[model, band] = band_wide
        if self._metrics is not None:
            self._metrics.set_confidence(model, self._class_names[band], band_wide)
