"""The simulator against queueing theory: M/M/c mean queue waits against Erlang C, M/G/1 against
Pollaczek-Khinchine, both from policies.capacity, within 5%.

Every point is Poisson arrivals at rate rho * c on c slots with a mean service time of 1 s, one
class, one tenant (so the engine's FIFO is fairness's single flow), and an unbounded queue.

How long each run is, and why:
- Warm-up. The queue starts empty and forgets it in about one relaxation time, 1/(mu (1 - sqrt
  rho)^2) for M/M/1 (c mu for M/M/c), stretched by (1 + cs^2)/2 for other service times as in
  heavy traffic; counted in arrivals, rho (1 + cs^2) / (2 (1 - sqrt rho)^2): 6 at 0.5, 72 at 0.8,
  1482 at 0.95 for exponential service. The first 30 of those (at least 1000 requests) are left
  out, so what is left of the empty start is far below the noise.
- Noise. The mean wait of n requests wavers by sqrt(K / n) of itself, K growing like 1/(1 - rho)^2
  (the queue's excursions last as long as its relaxation), and for lognormal service with cv 2
  also with the rare very long services. Much of it is the workload's own sampling: a run that
  drew a rate or a second moment of service times 1% high has waits several % high, as the
  formulas say it must. So each run is compared with the formula at the workload it drew (its
  measured arrival rate, its service times' mean and variance), which leaves the queue's own
  noise (it divides K by 2 to 3 at 0.95, by 2.5 or more for lognormal service);
  test_the_drawn_workload_has_the_rate_and_moments_asked_for checks that the draws converge to
  the nominal workload. K was measured from 60 seeds (20 at a tenth of each point's requests, 40
  at another tenth), so each K is known to about +-20%; the requests are chosen for 3.5 standard
  deviations in 5% (a seed fails a point with probability 5e-4, one of the 11 with 0.5%):

      point          K    requests  margin        point          K    requests  margin
      M/M/1  0.5    20     110 000  3.7 sd        M/M/1  0.8    66     330 000  3.5 sd
      M/M/2  0.5    27     140 000  3.6 sd        M/M/2  0.8    67     330 000  3.5 sd
      M/M/8  0.5   305   1 500 000  3.5 sd        M/M/8  0.8   193     950 000  3.5 sd
      M/D/1  0.5     9      50 000  3.7 sd        M/D/1  0.8    43     220 000  3.6 sd
      M/LN/1 0.5    50     250 000  3.5 sd        M/LN/1 0.8   251   1 250 000  3.5 sd
      M/D/1  0.95  384   1 900 000  3.5 sd

  (M/M/8 at 0.5 is costly for its mean: 6% of arrivals wait at all.) At 0.95 the other points
  have K of about 816 (M/M/1), 858 (M/M/2), 1016 (M/M/8) and 1644 (lognormal cv 2), from 20
  seeds each (+-30%): 4.0 to 8.1 million requests each for the same margin, 21 million in all,
  125 s on this machine, so they run only with SIMULATE_HEAVY_TRAFFIC=1. By default 0.95 is
  simulated at the one point 1.9 million requests settle, M/D/1, which runs the engine's
  heavy-traffic path (nearly every request queued and tagged) as the others would, on one slot.
  The points of a million requests and more are `slow`: the full suite runs them, the fast tier
  (`-m "not slow"`) the others.
"""

import math
import os
import random
from dataclasses import dataclass

import pytest

from gateway.tools.simulate.engine import Setup, simulate
from gateway.tools.simulate.workload import ServiceModel, poisson_arrivals
from policies import capacity

EXPONENTIAL = ServiceModel("exponential", 1.0)
FIXED = ServiceModel("fixed", 1.0, 0.0)
LOGNORMAL = ServiceModel("lognormal", 1.0, 2.0)
HEAVY = os.environ.get("SIMULATE_HEAVY_TRAFFIC") == "1"
# Opt-in, and beyond the suite's 60 s per test: the lognormal point alone takes about a minute.
heavy = [
    pytest.mark.skipif(not HEAVY, reason="minutes of simulation: set SIMULATE_HEAVY_TRAFFIC=1"),
    pytest.mark.timeout(600),
]


@dataclass(frozen=True, slots=True)
class Drawn:
    """The measured requests' arrival rate and service moments, as the run drew them."""

    arrival_rate: float
    service_mean: float
    service_variance: float


def warmup(service: ServiceModel, load: float) -> int:
    relaxation = load * (1 + service.cv**2) / (2 * (1 - math.sqrt(load)) ** 2)
    return max(1000, round(30 * relaxation))


def simulated_wait(
    service: ServiceModel, slots: int, load: float, requests: int, seed: int
) -> tuple[float, Drawn]:
    """The mean queue wait of `requests` measured requests, and the workload they drew."""
    skip = warmup(service, load)
    arrivals = poisson_arrivals(load * slots / service.mean_s, skip + requests, service, random.Random(seed))
    run = simulate(arrivals, Setup(slots, warmup=skip))
    tally = run.tallies[(0, "default")]
    assert tally.served == tally.arrived == requests
    mean = tally.service_s / requests
    drawn = Drawn(
        arrival_rate=(requests - 1) / (run.last_arrival_s - run.measured_from_s),
        service_mean=mean,
        service_variance=max(0.0, tally.service_squares_s2 / requests - mean * mean),
    )
    return math.fsum(tally.waits_s) / requests, drawn


MMC = [
    pytest.param(1, 0.5, 110_000, id="M/M/1-0.5"),
    pytest.param(2, 0.5, 140_000, id="M/M/2-0.5"),
    pytest.param(8, 0.5, 1_500_000, id="M/M/8-0.5", marks=pytest.mark.slow),
    pytest.param(1, 0.8, 330_000, id="M/M/1-0.8"),
    pytest.param(2, 0.8, 330_000, id="M/M/2-0.8"),
    pytest.param(8, 0.8, 950_000, id="M/M/8-0.8", marks=pytest.mark.slow),
    pytest.param(1, 0.95, 4_000_000, id="M/M/1-0.95", marks=heavy),
    pytest.param(2, 0.95, 4_200_000, id="M/M/2-0.95", marks=heavy),
    pytest.param(8, 0.95, 5_000_000, id="M/M/8-0.95", marks=heavy),
]


@pytest.mark.parametrize(("slots", "load", "requests"), MMC)
def test_mmc_mean_queue_wait_is_within_5_percent_of_erlang_c(slots, load, requests):
    wait, drawn = simulated_wait(EXPONENTIAL, slots, load, requests, seed=slots * 100 + round(load * 100))
    expected = capacity.mmc(drawn.arrival_rate, 1 / drawn.service_mean, slots).mean_wait
    nominal = capacity.mmc(load * slots, 1.0, slots).mean_wait
    assert abs(wait / expected - 1) < 0.05, (
        f"simulated {wait:.4f}, Erlang C {expected:.4f} (nominal {nominal:.4f})"
    )


MG1 = [
    pytest.param(FIXED, 0.5, 50_000, id="M/D/1-0.5"),
    pytest.param(LOGNORMAL, 0.5, 250_000, id="M/LN(cv2)/1-0.5"),
    pytest.param(FIXED, 0.8, 220_000, id="M/D/1-0.8"),
    pytest.param(LOGNORMAL, 0.8, 1_250_000, id="M/LN(cv2)/1-0.8", marks=pytest.mark.slow),
    pytest.param(FIXED, 0.95, 1_900_000, id="M/D/1-0.95", marks=pytest.mark.slow),
    pytest.param(LOGNORMAL, 0.95, 8_100_000, id="M/LN(cv2)/1-0.95", marks=heavy),
]


@pytest.mark.parametrize(("service", "load", "requests"), MG1)
def test_mg1_mean_queue_wait_is_within_5_percent_of_pollaczek_khinchine(service, load, requests):
    wait, drawn = simulated_wait(service, 1, load, requests, seed=round(load * 100) + round(10 * service.cv))
    expected = capacity.mg1(drawn.arrival_rate, 1 / drawn.service_mean, drawn.service_variance).mean_wait
    nominal = capacity.mg1(load, 1.0, service.variance_s2).mean_wait
    assert abs(wait / expected - 1) < 0.05, (
        f"simulated {wait:.4f}, P-K {expected:.4f} (nominal {nominal:.4f})"
    )


@pytest.mark.parametrize("service", [EXPONENTIAL, FIXED, LOGNORMAL], ids=lambda s: s.kind)
def test_the_drawn_workload_has_the_rate_and_moments_asked_for(service):
    # Each within 4 standard errors of n draws: the rate's 1/sqrt(n), the mean's cv/sqrt(n), an
    # exponential's deviation's sqrt(2/n) and a lognormal's log-scale deviation's 1/sqrt(2n).
    count = 250_000
    arrivals = list(poisson_arrivals(2.0, count, service, random.Random(1)))
    services = [a.service_s for a in arrivals]
    mean = math.fsum(services) / count
    rate = (count - 1) / (arrivals[-1].at_s - arrivals[0].at_s)
    assert abs(rate / 2.0 - 1) < 4 / math.sqrt(count)
    assert abs(mean / service.mean_s - 1) <= 4 * service.cv / math.sqrt(count)
    if service.kind == "lognormal":
        logs = [math.log(s) for s in services]
        log_mean = math.fsum(logs) / count
        log_sd = math.sqrt(math.fsum((x - log_mean) ** 2 for x in logs) / count)
        assert abs(log_sd / math.sqrt(math.log1p(service.cv**2)) - 1) < 4 / math.sqrt(2 * count)
    else:
        sd = math.sqrt(math.fsum((s - mean) ** 2 for s in services) / count)
        assert abs(sd - service.cv * service.mean_s) <= 4 * service.cv * math.sqrt(2 / count)
