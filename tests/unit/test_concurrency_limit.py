"""policies.concurrency_limit against a model of a continuous-batching engine.

The model: up to `max_num_seqs` sequences run, each step takes step_s x (1 + growth x (n-1)/(M-1))
with n running, and what the gateway sends beyond what runs waits inside (as long as a sequence
takes to finish, on average). The gateway always has work queued (saturating demand), so the
limit is all the engine sees from it; `others` are sequences another client keeps on the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from policies.concurrency_limit import EngineSample, LimitConfig, LimitState, limit_binds, next_limit, start


@dataclass
class EngineModel:
    max_num_seqs: int = 64
    step_s: float = 0.020
    growth: float = 1.0
    slowdown: float = 1.0
    output_tokens: int = 200
    others: int = 0
    deadline_s: float | None = None
    """The clients' deadline, with outputs drawn evenly from `outputs` (what late_share reports)."""
    outputs: tuple[int, int] = (50, 150)

    def step(self, running: int) -> float:
        crowd = (running - 1) / (self.max_num_seqs - 1)
        return self.step_s * (1 + self.growth * crowd) * self.slowdown

    def sample(self, limit: int) -> EngineSample:
        sent = limit + self.others
        running = min(sent, self.max_num_seqs)
        waiting = sent - running
        itl = self.step(running)
        service = self.output_tokens * itl
        queue_s = waiting / running * service if waiting else itl / 2
        late = None
        if self.deadline_s is not None:  # a request of T tokens ends at T x itl: late past the deadline
            low, high = self.outputs
            late = min(1.0, max(0.0, (high - self.deadline_s / itl) / (high - low)))
        return EngineSample(
            waiting=waiting,
            itl_s=itl,
            ttft_s=queue_s + itl,
            throughput=running / itl * limit / sent,  # our share of what it makes
            queue_s=queue_s,
            late_share=late,
        )


def run(engine: EngineModel, config: LimitConfig, scrapes: int, state: LimitState | None = None) -> list[int]:
    state = state or start(config)
    limits = []
    for _ in range(scrapes):
        state = next_limit(state, engine.sample(state.slots), True, config)
        limits.append(state.slots)
    run.state = state  # type: ignore[attr-defined]
    return limits


def steady(limits: list[int]) -> tuple[float, float]:
    """(mean, spread as a share of the mean) of a stretch of limits."""
    mean = sum(limits) / len(limits)
    return mean, (max(limits) - min(limits)) / mean


def test_it_finds_the_engines_max_num_seqs_when_only_its_queue_bounds_it_and_stays_there():
    limits = run(EngineModel(), LimitConfig(min_limit=1, max_limit=512), 120)
    assert max(limits) <= 512
    mean, spread = steady(limits[-60:])
    assert mean == pytest.approx(64, rel=0.1)  # the best fixed limit: all it runs, none waiting
    assert spread <= 0.1
    assert limits.index(next(x for x in limits if x >= 58)) <= 20  # found within 20 scrapes


def best_fixed_limit(engine: EngineModel, itl_objective_s: float) -> int:
    return max(n for n in range(1, engine.max_num_seqs + 1) if engine.step(n) <= itl_objective_s)


def test_it_finds_the_largest_limit_within_the_inter_token_latency_objective():
    engine = EngineModel()
    config = LimitConfig(min_limit=1, itl_objective_s=0.030)
    limits = run(engine, config, 120)
    best = best_fixed_limit(engine, 0.030)
    assert best == 32
    mean, spread = steady(limits[-60:])
    assert mean == pytest.approx(best, rel=0.1)
    assert spread <= 0.1


def test_deadlines_the_engine_keeps_let_the_limit_climb_past_any_latency_a_default_would_set():
    # A big model: 150 ms a step alone, 300 ms with 64 running (a default of 200 ms held it at 22).
    # Its clients give each request 30 s, which it keeps for them all at 64.
    engine = EngineModel(step_s=0.150, deadline_s=30.0)
    limits = run(engine, LimitConfig(min_limit=1), 60)
    mean, spread = steady(limits[-30:])
    assert mean == pytest.approx(64, rel=0.1) and spread <= 0.1
    assert limits.index(next(x for x in limits if x >= 58)) <= 12


def test_when_most_requests_would_miss_their_deadlines_the_limit_comes_down_to_where_most_do_not():
    # Steps of 20 ms that grow to 80 ms at 64 running; 50-150 tokens in 6 s. At 64 a request of
    # more than 75 tokens ends late (75% of them); at 43 (60 ms steps) those of more than 100: half.
    engine = EngineModel(growth=3.0, deadline_s=6.0)
    limits = run(engine, LimitConfig(min_limit=1), 120)
    mean, spread = steady(limits[-60:])
    assert 34 <= mean <= 45 and spread <= 0.25
    lowered = next_limit(LimitState(64.0), engine.sample(64), True, LimitConfig())
    assert lowered.limit == pytest.approx(64 * 0.5)  # (1 - 0.75) / 0.5 of it, at most halved
    assert lowered.cause == "75% of the deadlines missed" and lowered.ceiling == 64.0


def test_when_the_engine_slows_down_it_moves_to_the_new_best_within_a_few_scrapes():
    engine = EngineModel()
    config = LimitConfig(min_limit=1, itl_objective_s=0.030)
    run(engine, config, 100)
    engine.slowdown = 1.25
    after = run(engine, config, 60, run.state)  # type: ignore[attr-defined]
    best = best_fixed_limit(engine, 0.030)
    assert best == 13
    settled = next(i for i, limit in enumerate(after) if limit <= best * 1.1)
    assert settled <= 8
    mean, spread = steady(after[-40:])
    assert mean == pytest.approx(best, rel=0.1)
    assert spread <= 0.15  # one slot of 13 is 8%


def test_another_client_loading_the_engine_takes_its_share_from_the_limit():
    engine = EngineModel()
    config = LimitConfig(min_limit=1)
    run(engine, config, 100)
    engine.others = 20
    after = run(engine, config, 60, run.state)  # type: ignore[attr-defined]
    assert next(i for i, limit in enumerate(after) if limit <= 44 * 1.1) <= 6
    mean, spread = steady(after[-40:])
    assert mean == pytest.approx(44, rel=0.1)
    assert spread <= 0.1


def test_a_stale_engine_holds_the_limit_and_an_idle_one_does_not_raise_it():
    config = LimitConfig(min_limit=4)
    state = LimitState(40.0, ceiling=48.0)
    assert next_limit(state, None, True, config) == state
    calm = EngineSample(waiting=0, itl_s=0.02, throughput=100.0)
    assert next_limit(state, calm, False, config).limit == 40.0


def test_it_never_goes_above_its_cap_nor_below_its_floor():
    config = LimitConfig(min_limit=2, max_limit=10)
    limits = run(EngineModel(), config, 50)
    assert max(limits) == 10
    crowded = EngineModel(others=500)
    assert min(run(crowded, config, 30)) == 2


def test_a_request_waiting_for_the_next_step_is_no_congestion():
    config = LimitConfig()
    state = LimitState(30.0, ceiling=40.0, waiting_streak=5)
    between_steps = EngineSample(waiting=3, itl_s=0.02, queue_s=0.015, throughput=100.0)
    assert next_limit(state, between_steps, True, config).limit == 30  # no cut; no rise either
    just_sent = EngineSample(waiting=1, itl_s=0.25, queue_s=0.1, throughput=100.0)
    assert next_limit(state, just_sent, True, config).limit == 35  # one waiting for the next step
    queued = EngineSample(waiting=3, itl_s=0.02, queue_s=0.5, throughput=100.0)
    assert next_limit(state, queued, True, config).limit == 30 - 1.5  # half the queue inside


def test_preemption_and_a_slow_first_token_bring_the_limit_down():
    config = LimitConfig(ttft_objective_s=1.0)
    state = LimitState(50.0)
    preempting = EngineSample(waiting=0, preempted=2, itl_s=0.02)
    assert next_limit(state, preempting, True, config).limit == pytest.approx(47.5)
    slow = EngineSample(waiting=0, ttft_s=2.0, itl_s=0.02)
    lowered = next_limit(state, slow, True, config)
    assert lowered.limit == pytest.approx(25.0)
    assert lowered.ceiling == 50.0
    # The operator's log says why.
    assert next_limit(state, preempting, True, config).cause == "2 preempted"
    assert lowered.cause == "first-token latency 2000 ms over 1000 ms"
    assert next_limit(state, EngineSample(waiting=0, itl_s=0.02), True, config).cause == "slow start"


def test_a_rise_that_brings_no_throughput_ends_the_climb():
    config = LimitConfig(min_limit=8)
    state = start(config)
    flat = EngineSample(waiting=0, itl_s=0.02, throughput=500.0)
    risen = next_limit(state, flat, True, config)
    assert risen.limit == 12.0
    judged = next_limit(risen, flat, True, config)
    assert judged.limit == 12.0  # the next scrape may catch its new sequences in prefill: it holds
    assert next_limit(judged, flat, True, config) == LimitState(8.0, ceiling=8.0)


def test_a_rise_whose_gain_shows_a_scrape_late_goes_on():
    config = LimitConfig(min_limit=8)
    flat = EngineSample(waiting=0, itl_s=0.02, throughput=500.0)
    risen = next_limit(start(config), flat, True, config)
    waiting = next_limit(risen, flat, True, config)
    gained = next_limit(waiting, EngineSample(waiting=0, itl_s=0.02, throughput=700.0), True, config)
    assert gained.limit == 18.0 and gained.ceiling is None  # slow start goes on


samples = st.one_of(
    st.none(),
    st.builds(
        EngineSample,
        waiting=st.floats(0, 1000),
        preempted=st.floats(0, 10),
        ttft_s=st.one_of(st.none(), st.floats(0, 100)),
        itl_s=st.one_of(st.none(), st.floats(0, 10)),
        throughput=st.one_of(st.none(), st.floats(0, 1e6)),
        queue_s=st.one_of(st.none(), st.floats(0, 100)),
        late_share=st.one_of(st.none(), st.floats(0, 1)),
    ),
)


@given(st.lists(st.tuples(samples, st.booleans()), max_size=60), st.floats(1, 50), st.floats(50, 500))
def test_the_limit_stays_within_its_bounds_whatever_the_engine_says(steps, low, high):
    config = LimitConfig(min_limit=low, max_limit=high, ttft_objective_s=1.0, itl_objective_s=0.1)
    state = start(config)
    for sample, demand in steps:
        state = next_limit(state, sample, demand, config)
        assert low <= state.limit <= high
        assert state.slots >= 1


@pytest.mark.parametrize(
    ("queued", "free", "slots", "offered", "admitted", "binds"),
    [
        (True, 5, 16, 0.0, 0.0, True),  # work queued for the engine
        (False, 0, 16, 0.0, 0.0, True),  # every slot used
        (False, 1, 16, 10.0, 6.0, True),  # refusing 40% at the door, one slot free between hand-overs
        (False, 8, 16, 10.0, 6.0, False),  # refusing with half the slots free: not the limit's doing
        (False, 1, 16, 10.0, 9.6, False),  # refusing 4%: noise
        (False, 1, 16, 0.0, 0.0, False),  # idle
        (False, 6, 64, 10.0, 1.0, True),  # a tenth of 64 free still counts as all but used
    ],
)
def test_the_limit_binds_on_queued_work_a_full_pool_or_turned_away_work_with_slots_all_but_used(
    queued, free, slots, offered, admitted, binds
):
    assert limit_binds(queued, free, slots, offered, admitted) is binds
