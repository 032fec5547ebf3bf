"""How many replicas for a target wait? Steady-state queue waits and the replica count that meets a target.

Every model here has Poisson arrivals at `arrival_rate` and `servers` identical servers, each
completing `service_rate` requests per unit of time. Any unit will do as long as it is one unit
throughout: rates per hour give waits in hours. A wait is the time in the queue before service.

- M/M/c (exponential service), Erlang C: the offered load is a = lambda / mu and the probability
  that an arrival waits is C = c*B / (c - a*(1 - B)), B from the Erlang B recursion B(0) = 1,
  B(k) = a*B(k-1) / (k + a*B(k-1)). No factorial or power is ever formed, so it stays finite for
  thousands of servers. The mean wait is C / (c*mu - lambda) and P(wait > t) = C*exp(-(c*mu - lambda)*t).
- M/G/1 (any service time distribution), Pollaczek-Khinchine, exact:
  Wq = lambda * E[S^2] / (2 * (1 - rho)), E[S^2] = Var[S] + 1/mu^2.
- M/G/c, the Allen-Cunneen approximation: Wq ~ Wq(M/M/c) * (Ca^2 + Cs^2) / 2 with Ca = 1 (Poisson)
  and Cs the service time's coefficient of variation. It is exact for Cs = 1 and for one server,
  where it is Pollaczek-Khinchine.

Utilization rho = lambda / (c*mu) at or above 1 has no steady state: such an estimate says so with
an infinite wait and P(wait) = 1, never with an exception or a division by zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Binding = Literal["utilization", "mean_wait", "p_wait", "minimum"]


@dataclass(frozen=True, slots=True)
class WaitEstimate:
    """The steady-state queue wait of one pool, in the time unit of the rates it was computed from."""

    servers: int
    utilization: float
    """lambda / (c*mu): the share of server time that is busy."""
    p_wait: float
    """Probability that an arrival finds every server busy and has to wait."""
    mean_wait: float
    """Mean time in the queue before service starts; inf when unstable."""
    tail_rate: float
    """P(wait > t) = p_wait * exp(-tail_rate * t) for t >= 0; 0 when unstable."""

    @property
    def stable(self) -> bool:
        """True when the queue has a steady state (utilization below 1)."""
        return self.utilization < 1.0

    def wait_exceeded(self, t: float) -> float:
        """Probability that an arrival waits longer than `t` (t >= 0)."""
        if not self.stable:
            return 1.0
        return self.p_wait * math.exp(-self.tail_rate * t)

    def wait_percentile(self, q: float) -> float:
        """The wait that a share `q` (0 <= q < 1, e.g. 0.95) of arrivals do not exceed.

        0 when at least that share is served at once; inf when unstable. For an M/G/c estimate
        the tail is the M/M/c exponential stretched to the Allen-Cunneen mean (see `mgc`).
        """
        if not 0.0 <= q < 1.0:
            raise ValueError(f"percentile share must be in [0, 1), got {q}")
        if not self.stable:
            return math.inf
        if self.p_wait <= 1.0 - q:
            return 0.0
        return math.log(self.p_wait / (1.0 - q)) / self.tail_rate


@dataclass(frozen=True, slots=True)
class Targets:
    """What a pool must achieve: any of the wait targets given, at no more than `max_utilization`."""

    mean_wait: float | None = None
    """Largest acceptable mean queue wait, in the rates' time unit."""
    p_wait: float | None = None
    """Largest acceptable probability of waiting at all."""
    max_utilization: float = 0.8
    """Interactive pools are kept at 70-80% busy, whatever the wait model says."""

    def met_by(self, estimate: WaitEstimate) -> bool:
        """True when the estimate is stable, within the ceiling and meets every target given."""
        return self.broken_by(estimate) is None

    def broken_by(self, estimate: WaitEstimate) -> Binding | None:
        """The first constraint the estimate breaks (utilization, mean wait, P(wait)), or None."""
        if not estimate.stable or estimate.utilization > self.max_utilization:
            return "utilization"
        if self.mean_wait is not None and estimate.mean_wait > self.mean_wait:
            return "mean_wait"
        if self.p_wait is not None and estimate.p_wait > self.p_wait:
            return "p_wait"
        return None


@dataclass(frozen=True, slots=True)
class Recommendation:
    """The smallest replica count meeting the targets, and the wait it gives."""

    replicas: int
    estimate: WaitEstimate
    bound_by: Binding
    """What one replica fewer would break; "minimum" when one replica is enough."""
    met: bool
    """False only when `max_replicas` replicas still miss the targets (then replicas == max_replicas)."""


def erlang_b(servers: int, offered_load: float) -> float:
    """Erlang B: the probability that all `servers` are busy in a loss system offered `offered_load`.

    An infinite load (a rate ratio that overflowed) keeps every server busy: 1.0.
    """
    _check_servers(servers)
    if not offered_load >= 0.0:
        raise ValueError(f"offered_load must be >= 0, got {offered_load}")
    if math.isinf(offered_load):
        return 1.0
    blocking = 1.0
    for k in range(1, servers + 1):
        blocking = offered_load * blocking / (k + offered_load * blocking)
    return blocking


def erlang_c(servers: int, offered_load: float) -> float:
    """Erlang C: the probability that an arrival waits in M/M/c; 1.0 when offered_load >= servers."""
    return _erlang_c_from_b(servers, offered_load, erlang_b(servers, offered_load))


def mmc(arrival_rate: float, service_rate: float, servers: int) -> WaitEstimate:
    """M/M/c wait: Erlang C probability of waiting, mean C/(c*mu - lambda), exponential tail."""
    return mgc(arrival_rate, service_rate, servers, service_cv=1.0)


def mgc(arrival_rate: float, service_rate: float, servers: int, service_cv: float) -> WaitEstimate:
    """M/G/c wait by Allen-Cunneen: the M/M/c mean wait scaled by (1 + service_cv^2) / 2.

    P(wait) is Erlang C's. The tail keeps the M/M/c exponential shape, P(wait > t) = C*exp(-r*t),
    with its rate r chosen so that the mean is the scaled one: an approximation for percentiles,
    as the mean itself is.
    """
    _check_rates(arrival_rate, service_rate)
    _check_nonnegative("service_cv", service_cv)
    load = arrival_rate / service_rate
    return _estimate(arrival_rate, service_rate, servers, erlang_b(servers, load), service_cv)


def mg1(arrival_rate: float, service_rate: float, service_variance: float) -> WaitEstimate:
    """M/G/1 wait by Pollaczek-Khinchine: mean lambda*E[S^2] / (2(1 - rho)), P(wait) = rho, exact.

    The tail is exponential with that mean (exact only for exponential service).
    """
    _check_rates(arrival_rate, service_rate)
    _check_nonnegative("service_variance", service_variance)
    rho = arrival_rate / service_rate
    if rho >= 1.0:
        return WaitEstimate(1, rho, 1.0, math.inf, 0.0)
    second_moment = service_variance + 1.0 / service_rate**2
    mean = arrival_rate * second_moment / (2.0 * (1.0 - rho))
    # With no arrivals nobody waits; any finite tail rate then says so without a 0 * inf.
    return WaitEstimate(1, rho, rho, mean, rho / mean if mean > 0 else service_rate)


def replicas_for(
    arrival_rate: float,
    service_rate: float,
    targets: Targets,
    *,
    service_cv: float = 1.0,
    servers_per_replica: int = 1,
    max_replicas: int = 100_000,
) -> Recommendation:
    """The smallest replica count whose M/G/c estimate meets `targets`.

    Each replica holds `servers_per_replica` servers (a model server's slots), each serving at
    `service_rate`. Waits only shrink as replicas are added, so the first count that meets every
    target is the answer and one fewer breaks `bound_by`. Past `max_replicas` the search stops
    with `met=False`.
    """
    _check_rates(arrival_rate, service_rate)
    _check_nonnegative("service_cv", service_cv)
    _check_targets(targets)
    _check_servers(servers_per_replica)
    _check_servers(max_replicas)
    load = arrival_rate / service_rate
    # Start just below the utilization ceiling's minimum and walk up, carrying Erlang B along.
    # (The min() keeps an overflowing load, inf, away from floor().)
    at_ceiling = load / (servers_per_replica * targets.max_utilization)
    first = max(1, math.floor(min(at_ceiling, max_replicas + 1.0)) - 1)
    servers = first * servers_per_replica
    blocking = erlang_b(servers, load)
    previous: WaitEstimate | None = None
    replicas = first
    while True:
        estimate = _estimate(arrival_rate, service_rate, servers, blocking, service_cv)
        if targets.met_by(estimate):
            if replicas > 1 and previous is None:
                previous = mgc(arrival_rate, service_rate, servers - servers_per_replica, service_cv)
            broken = targets.broken_by(previous) if previous is not None else None
            return Recommendation(replicas, estimate, broken or "minimum", met=True)
        if replicas >= max_replicas:
            return Recommendation(replicas, estimate, targets.broken_by(estimate) or "minimum", met=False)
        previous = estimate
        replicas += 1
        for _ in range(servers_per_replica):
            servers += 1
            blocking = load * blocking / (servers + load * blocking)


def _estimate(
    arrival_rate: float, service_rate: float, servers: int, blocking: float, service_cv: float
) -> WaitEstimate:
    load = arrival_rate / service_rate
    utilization = load / servers
    if utilization >= 1.0:
        return WaitEstimate(servers, utilization, 1.0, math.inf, 0.0)
    p_wait = _erlang_c_from_b(servers, load, blocking)
    decay = servers * service_rate - arrival_rate
    stretch = (1.0 + service_cv**2) / 2.0  # at least 1/2: never divides by zero
    return WaitEstimate(servers, utilization, p_wait, p_wait / decay * stretch, decay / stretch)


def _erlang_c_from_b(servers: int, load: float, blocking: float) -> float:
    if load >= servers:
        return 1.0
    return min(1.0, servers * blocking / (servers - load * (1.0 - blocking)))


def _check_servers(servers: int) -> None:
    if servers < 1:
        raise ValueError(f"need at least one server or replica, got {servers}")


def _check_nonnegative(name: str, value: float) -> None:
    if not value >= 0.0 or math.isinf(value):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")


def _check_rates(arrival_rate: float, service_rate: float) -> None:
    _check_nonnegative("arrival_rate", arrival_rate)
    if not 0.0 < service_rate < math.inf:
        raise ValueError(f"service_rate must be a finite number > 0, got {service_rate}")


def _check_targets(targets: Targets) -> None:
    if not 0.0 < targets.max_utilization <= 1.0:
        raise ValueError(f"max_utilization must be in (0, 1], got {targets.max_utilization}")
    if targets.mean_wait is not None and not targets.mean_wait > 0.0:
        raise ValueError(f"target mean wait must be > 0, got {targets.mean_wait}")
    if targets.p_wait is not None and not 0.0 < targets.p_wait <= 1.0:
        raise ValueError(f"target P(wait) must be in (0, 1], got {targets.p_wait}")
