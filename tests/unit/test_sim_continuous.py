"""The simulator's continuous-batching engine against its own specification, in virtual time."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.tools.model_server.continuous import ContinuousBatch, ContinuousSpec, Sequence
from gateway.tools.model_server.tokens import count_tokens, natural_output_tokens, prompt_tokens
from gateway.tools.model_server.vllm_metrics import ITL_BUCKETS_S, TTFT_BUCKETS_S, VllmMetrics


class VirtualRun:
    """Steps a ContinuousBatch on a virtual clock."""

    def __init__(self, spec: ContinuousSpec) -> None:
        self.batch = ContinuousBatch(spec)
        self.now = 0.0
        self.steps: list[float] = []

    def submit(self, prompt: int, output: int, priority: int = 0) -> Sequence:
        sequence = Sequence("m", prompt, output, self.now, priority)
        self.batch.submit(sequence)
        return sequence

    def step(self) -> float:
        seconds = self.batch.begin_step(self.now)
        self.steps.append(seconds)
        self.now += seconds
        self.batch.end_step(self.now)
        return seconds

    def until_idle(self, max_steps: int = 100_000) -> None:
        for _ in range(max_steps):
            if self.batch.idle:
                return
            self.step()
        raise AssertionError("the batch never went idle")


def test_the_step_takes_step_ms_alone_and_doubles_at_max_num_seqs_with_growth_one():
    spec = ContinuousSpec(max_num_seqs=64, step_ms=10, step_growth=1.0, prefill_ms_per_1k=0)
    assert spec.step_s(1, 0, 0) == pytest.approx(0.010)
    assert spec.step_s(64, 0, 0) == pytest.approx(0.020)
    assert spec.step_s(32, 0, 0) == pytest.approx(0.010 * (1 + 31 / 63))  # linear in between
    with_context = ContinuousSpec(step_ms=10, context_ms_per_1k=2, prefill_ms_per_1k=5)
    assert with_context.step_s(1, 3000, 2000) == pytest.approx(0.010 + 0.006 + 0.010)


def test_throughput_grows_with_the_sequences_running_while_each_step_slows():
    spec = ContinuousSpec(max_num_seqs=64, step_ms=10, step_growth=1.0, prefill_ms_per_1k=0)
    alone = VirtualRun(spec)
    alone.submit(10, 100)
    alone.until_idle()
    crowd = VirtualRun(spec)
    for _ in range(64):
        crowd.submit(10, 100)
    crowd.until_idle()
    assert alone.now == pytest.approx(100 * 0.010)
    assert crowd.now == pytest.approx(100 * 0.020)  # each step twice as long...
    assert (64 * 100 / crowd.now) / (100 / alone.now) == pytest.approx(32)  # ...32x the tokens
    assert crowd.batch.counters.generation_tokens == 6400
    assert crowd.batch.stats.completed == 64


def test_no_more_than_max_num_seqs_run_and_the_rest_wait_inside_in_order():
    run = VirtualRun(ContinuousSpec(max_num_seqs=4, step_ms=10))
    sequences = [run.submit(10, 5) for _ in range(6)]
    run.step()
    assert run.batch.running == sequences[:4]
    assert list(run.batch.waiting) == sequences[4:]
    assert run.batch.stats.inflight == 6
    run.until_idle()
    assert all(s.generated == 5 for s in sequences)


def test_the_kv_budget_keeps_requests_waiting_inside_though_sequences_are_free():
    run = VirtualRun(ContinuousSpec(max_num_seqs=64, step_ms=10, kv_tokens=1000))
    sequences = [run.submit(300, 4) for _ in range(5)]
    run.step()
    assert len(run.batch.running) == 3  # 3 x 300 + their next tokens fit in 1000; a 4th does not
    assert len(run.batch.waiting) == 2
    assert run.batch.kv_used == 3 * 301
    run.until_idle()
    assert all(s.finished for s in sequences)
    assert run.batch.kv_used == 0


def test_past_the_kv_budget_while_running_the_last_started_is_preempted_and_recomputed():
    run = VirtualRun(ContinuousSpec(max_num_seqs=64, step_ms=10, prefill_ms_per_1k=100, kv_tokens=610))
    first, second = run.submit(300, 20), run.submit(300, 20)
    for _ in range(5):
        run.step()  # 600 + 2 per step: the 6th step's tokens do not fit
    assert run.batch.counters.preemptions == 0
    run.step()
    assert run.batch.counters.preemptions == 1
    assert run.batch.running == [first]
    assert list(run.batch.waiting) == [second]
    run.until_idle()
    assert first.generated == second.generated == 20
    # Its restart prefilled its prompt and the tokens it had made again.
    assert pytest.approx(0.010 + 0.1 * (300 + 5) / 1000) in run.steps
    assert run.batch.counters.prompt_tokens == 600  # the prompt counts once


def test_under_the_priority_policy_the_lower_value_starts_first_and_is_preempted_last():
    run = VirtualRun(ContinuousSpec(max_num_seqs=1, step_ms=10, scheduling="priority"))
    run.submit(10, 1, priority=5)
    run.step()
    late = run.submit(10, 1, priority=10)
    urgent = run.submit(10, 1, priority=0)
    assert list(run.batch.waiting) == [urgent, late]
    run.until_idle()
    assert urgent.first_token_at is not None and late.first_token_at is not None
    assert urgent.first_token_at < late.first_token_at

    squeezed = VirtualRun(ContinuousSpec(step_ms=10, scheduling="priority", kv_tokens=25))
    low = squeezed.submit(10, 8, priority=10)
    high = squeezed.submit(10, 8, priority=0)
    squeezed.step()
    squeezed.step()
    squeezed.step()  # 20 + 2 + 2 + 2 > 25: one must go, the less urgent
    assert squeezed.batch.running == [high]
    assert list(squeezed.batch.waiting) == [low]


def test_an_aborted_sequence_leaves_at_once_and_gives_back_its_cache():
    run = VirtualRun(ContinuousSpec(max_num_seqs=1, step_ms=10))
    running, waiting = run.submit(100, 50), run.submit(100, 50)
    run.step()
    run.batch.abort(waiting)
    run.batch.abort(running)
    run.batch.abort(running)  # idempotent
    assert run.batch.idle and run.batch.kv_used == 0
    assert run.batch.stats.stopped == 2 and run.batch.stats.inflight == 0
    assert run.batch.stats.completed == 0


def test_first_token_and_inter_token_latencies_are_those_of_the_steps():
    run = VirtualRun(ContinuousSpec(step_ms=10, prefill_ms_per_1k=1000))
    run.submit(100, 3)
    run.until_idle()
    counters = run.batch.counters
    assert list(counters.ttft_s) == pytest.approx([0.010 + 0.100])
    assert list(counters.itl_s) == pytest.approx([0.010, 0.010])


def test_the_metrics_are_vllms_names_types_labels_and_buckets():
    run = VirtualRun(ContinuousSpec(max_num_seqs=2, step_ms=10, kv_tokens=1000))
    for _ in range(3):
        run.submit(100, 4)
    run.step()
    families = {
        f.name: f for f in text_string_to_metric_families(VllmMetrics(run.batch, "llama").render().decode())
    }
    # prometheus-client's `_created` series (vLLM's too) are read back as families of their own.
    types = {name: f.type for name, f in families.items() if not name.endswith("_created")}
    assert types == {
        "vllm:num_requests_waiting": "gauge",
        "vllm:num_requests_running": "gauge",
        "vllm:kv_cache_usage_perc": "gauge",
        "vllm:num_preemptions": "counter",
        "vllm:prompt_tokens": "counter",
        "vllm:generation_tokens": "counter",
        "vllm:time_to_first_token_seconds": "histogram",
        "vllm:inter_token_latency_seconds": "histogram",
        "vllm:request_queue_time_seconds": "histogram",
    }

    def value(sample_name: str) -> float:
        family = sample_name.removesuffix("_total")
        (sample,) = [s for s in families[family].samples if s.name == sample_name]
        assert sample.labels == {"model_name": "llama", "engine": "0"}
        return sample.value

    assert value("vllm:num_requests_waiting") == 1
    assert value("vllm:num_requests_running") == 2
    assert value("vllm:kv_cache_usage_perc") == pytest.approx(202 / 1000)
    assert value("vllm:prompt_tokens_total") == 200
    assert value("vllm:generation_tokens_total") == 2
    ttft = [s for s in families["vllm:time_to_first_token_seconds"].samples if s.name.endswith("_bucket")]
    assert [float(s.labels["le"]) for s in ttft] == [*TTFT_BUCKETS_S, float("inf")]
    itl = [s for s in families["vllm:inter_token_latency_seconds"].samples if s.name.endswith("_bucket")]
    assert [float(s.labels["le"]) for s in itl] == [*ITL_BUCKETS_S, float("inf")]


def test_the_tokenizer_counts_pieces_by_four_characters_and_chat_templates_add_tokens():
    assert count_tokens("") == 0
    assert count_tokens("hi there!") == 1 + 2 + 1
    assert count_tokens("internationalization") == 5
    chat = {"messages": [{"role": "user", "content": "hi there!"}]}
    assert prompt_tokens(chat, chat=True) == 4 + 4 + 3
    assert prompt_tokens({"prompt": [1, 2, 3, 4]}, chat=False) == 4
    lengths = [natural_output_tokens(f"prompt {i}", 50) for i in range(2000)]
    assert min(lengths) >= 1 and max(lengths) <= 100
    assert 45 < sum(lengths) / len(lengths) < 56
    assert natural_output_tokens("same", 50) == natural_output_tokens("same", 50)


def test_a_spec_that_cannot_run_is_refused():
    with pytest.raises(ValueError):
        ContinuousSpec(max_num_seqs=0)
    with pytest.raises(ValueError):
        ContinuousSpec(kv_tokens=0)
