"""How much margin should admission take, so that the requests it admits expire in the queue at
the rate the operator chose? A feedback loop on outcomes, not a constant.

Admission admits a request when the work ahead of it drains within its allowed wait with
probability `confidence` (policies.handovers). If the predictor were exact, 1 - confidence of the
admitted requests that queue would expire there. It is not: a pessimistic model (service times
taken as more variable than they are, a stale prior) refuses work that would have fitted, and an
optimistic one lets work rot. So the confidence is steered by what happened: each admitted
request that queued is a Bernoulli trial, expired or not, and the log-odds of the miss probability
1 - confidence move by `gain` x (target - outcome), a stochastic approximation (Robbins-Monro)
whose only fixed point is an expiry share equal to `target_expiry`. A pessimistic predictor sees
no expiries and loosens a little per admitted request; an optimistic one tightens by a large step
per expiry. Requests granted a slot at once carry no risk and no information, so they do not
count; nor does a light load wind the margin up, since nothing queues then.

The confidence starts at the normal quantile of `admission.safety_sigmas` and is clamped, so a
long run without expiries cannot loosen admission past the median, nor a burst of expiries
tighten it beyond use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist


@dataclass(frozen=True, slots=True)
class CalibrationConfig:
    target_expiry: float = 0.01
    """The share of admitted requests that queued which may expire in the queue."""
    gain: float = 0.1
    """Log-odds moved per unit of surprise: an expiry tightens by about gain, 1 / target_expiry
    requests served in time loosen by about as much. Small, because the outcomes come late and
    together: a request's fate is known only when its wait ends (seconds), and one slow stretch of
    the pool expires a queue's worth at once. At 1, under sustained overload with exponential
    service times and 5 s waits, the confidence swung between its clamps and 5% expired; at 0.1,
    1.5% (the simulator, the gateway's own admission)."""
    min_confidence: float = 0.5
    max_confidence: float = 0.9999


def starting_confidence(safety_sigmas: float, config: CalibrationConfig) -> float:
    """The confidence a margin of `safety_sigmas` standard deviations gave a normal wait, within
    the clamp: past about 8.3 sigmas the normal's cdf is 1.0, a certainty no prediction can give."""
    return min(config.max_confidence, max(config.min_confidence, NormalDist().cdf(safety_sigmas)))


def confidence_after(confidence: float, expired: bool, config: CalibrationConfig) -> float:
    """The confidence after one more admitted request that queued left the queue, `expired` or
    served in time."""
    miss = 1.0 - confidence
    log_odds = math.log(miss / (1.0 - miss))
    log_odds += config.gain * (config.target_expiry - (1.0 if expired else 0.0))
    miss = 1.0 / (1.0 + math.exp(-log_odds))
    return min(config.max_confidence, max(config.min_confidence, 1.0 - miss))
