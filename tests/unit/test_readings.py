"""Reading the servers' real exposition formats (shared/reference): any label order, unknown labels."""

from pathlib import Path

import pytest

from gateway.signals.exposition import Exposition
from gateway.signals.readings import read_kueue, read_server
from gateway.upstream.discovery import TritonModel

DATA = Path(__file__).parents[1] / "data"
# The real /metrics of tritonserver 2.51 (nvidia-pytriton), and samples with the labels of GPU
# builds, vLLM V1 and Kueue v0.16+ (../shared/reference/metric-formats.md).
TRITON_CAPTURE = (DATA / "triton-2.51-metrics.txt").read_text()

TRITON_GPU = (DATA / "triton-gpu-sample.txt").read_text()

VLLM = (DATA / "vllm-sample.txt").read_text()

KUEUE = (DATA / "kueue-sample.txt").read_text()


def test_the_real_triton_capture_reads():
    reading = read_server(Exposition.parse(TRITON_CAPTURE), "sleep_ms")
    assert reading is not None
    assert reading.waiting == 0
    assert reading.request_success == 1
    assert reading.queue_duration_us == 2195
    assert reading.exec_count == 1


def test_triton_series_sum_over_versions_and_gpus_whatever_the_label_order():
    reading = read_server(Exposition.parse(TRITON_GPU), "resnet50")
    assert reading is not None
    assert reading.waiting == 15
    assert reading.queue_duration_us == 8341112
    assert reading.request_success == 1523


def test_vllm_sums_engines_and_takes_the_only_model_when_the_names_differ():
    reading = read_server(Exposition.parse(VLLM), "llama")
    assert reading is not None
    assert (reading.waiting, reading.running, reading.kv_cache_usage) == (9.0, 64.0, 0.83)


def test_kueue_pending_and_wait_buckets_for_one_cluster_queue():
    reading = read_kueue(Exposition.parse(KUEUE), "gpu-serving")
    assert reading is not None
    assert (reading.pending_active, reading.pending_inadmissible) == (3, 1)
    assert reading.admission_wait_buckets == {1.0: 4, 2.5: 7, float("inf"): 10}


def test_text_of_neither_server_reads_as_nothing():
    assert read_server(Exposition.parse("# TYPE up gauge\nup 1\n"), "m") is None
    assert read_kueue(Exposition.parse("# TYPE up gauge\nup 1\n"), "q") is None


def test_malformed_text_is_an_error():
    with pytest.raises(ValueError):
        Exposition.parse("this is { not exposition\n")


@pytest.mark.parametrize(
    ("config", "slots"),
    [
        ({"max_batch_size": 8, "dynamic_batching": {}, "instance_group": [{"count": 2}]}, 16),
        ({"max_batch_size": 8, "instance_group": [{"count": 2}]}, 2),  # no dynamic batching
        ({"max_batch_size": 0, "dynamic_batching": {}}, 1),
        ({"instance_group": [{"count": 1}, {"count": 3}]}, 4),
    ],
)
def test_triton_slots_from_the_model_config(config, slots):
    assert TritonModel.from_config(True, config).slots == slots


def test_a_triton_page_without_the_model_says_nothing_of_it_rather_than_zero():
    assert read_server(Exposition.parse(TRITON_CAPTURE), "not-loaded-here") is None
    two = (
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="a"} 1\nvllm:num_requests_waiting{model_name="b"} 2\n'
    )
    assert read_server(Exposition.parse(two), "c") is None
    assert read_server(Exposition.parse(two), "b").waiting == 2


def test_a_gauge_that_is_not_a_number_is_no_reading_rather_than_nan():
    page = (
        "# TYPE nv_inference_pending_request_count gauge\n"
        'nv_inference_pending_request_count{model="m",version="1"} NaN\n'
        "# TYPE kueue_pending_workloads gauge\n"
        'kueue_pending_workloads{cluster_queue="q",status="active"} +Inf\n'
    )
    exposition = Exposition.parse(page)
    assert exposition.total("nv_inference_pending_request_count") is None
    reading = read_server(exposition, "m")
    assert reading is not None and reading.waiting == 0.0  # NaN would reach int() on every request
    kueue = read_kueue(exposition, "q")
    assert kueue is not None and kueue.pending_active == 0.0
