"""Each model and band's admission confidence, kept as state and steered by policies.calibration."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.telemetry.metrics import GatewayMetrics
from policies.calibration import CalibrationConfig, confidence_after, starting_confidence


class Calibrations:
    """The confidence admission asks of each (model, band), from `safety_sigmas` at first, then
    moved by every admitted request that queued: served in time, or expired in the queue."""

    def __init__(
        self,
        class_names: Sequence[str],
        config: CalibrationConfig,
        safety_sigmas: float,
        metrics: GatewayMetrics,
    ) -> None:
        self._class_names = list(class_names)
        self._config = config
        self._start = starting_confidence(safety_sigmas, config)
        self._metrics = metrics
        self._confidence: dict[tuple[str, int], float] = {}

    def confidence(self, model: str, band: int) -> float:
        return self._confidence.get((model, band), self._start)

    def settled(self, model: str, band: int, expired: bool) -> None:
        """An admitted request that waited in the queue left it: `expired`, or with its slot."""
        confidence = confidence_after(self.confidence(model, band), expired, self._config)
        self._confidence[model, band] = confidence
        self._metrics.set_confidence(model, self._class_names[band], confidence)
