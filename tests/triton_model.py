"""A real tritonserver (bundled by nvidia-pytriton) serving `sleep_ms`: a model that sleeps a fixed
time per batch and returns its input, with dynamic batching on; and `typed_echo`, which does the
same for one input of each datatype the gateway's batching must carry (FP16, INT64, BOOL, BYTES);
and `count_up`, a decoupled model: three responses to each request, `sleep_ms` apart, the k-th its
input plus k (as an LLM's engine streams tokens through Triton), then the final flag on its own;
each response says in RUNNING how many count_up requests the server runs then (its own count).

    python -m tests.triton_model --http-port P --grpc-port G --metrics-port M --sleep-ms 100

`--no-dynamic-batching` serves it without Triton's dynamic batcher: one batch at a time, of what
one request carries (what the gateway's own batching is for).

The tests start it as a subprocess (see tests/integration/triton.py).
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from collections.abc import Iterator

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig

from tests.integration.triton import COUNT_UP_INSTANCES, COUNT_UP_RESPONSES


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http-port", type=int, required=True)
    parser.add_argument("--grpc-port", type=int, required=True)
    parser.add_argument("--metrics-port", type=int, required=True)
    parser.add_argument("--sleep-ms", type=float, default=100.0)
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--dynamic-batching", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--hold-file", help="while this file exists, every inference waits before its work")
    args = parser.parse_args()

    @batch
    def sleep_then_echo(INPUT0: np.ndarray) -> dict[str, np.ndarray]:
        while args.hold_file and os.path.exists(args.hold_file):
            time.sleep(0.005)  # held by a test until what it needs has queued behind
        time.sleep(args.sleep_ms / 1000)  # the model's work: a fixed service time
        return {"OUTPUT0": INPUT0}

    @batch
    def typed_echo(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        while args.hold_file and os.path.exists(args.hold_file):
            time.sleep(0.005)
        time.sleep(args.sleep_ms / 1000)
        return {name.replace("IN_", "OUT_"): value for name, value in inputs.items()}

    running = [0]  # count_up's requests between their start and their last response
    counting = threading.Lock()

    def count_up(requests: list) -> Iterator[list[dict[str, np.ndarray]]]:
        with counting:
            running[0] += len(requests)
        try:
            for step in range(COUNT_UP_RESPONSES):
                while args.hold_file and os.path.exists(args.hold_file):
                    time.sleep(0.005)
                time.sleep(args.sleep_ms / 1000)
                now = np.array([running[0]], dtype=np.int32)
                yield [{"OUTPUT0": r["INPUT0"] + np.float32(step), "RUNNING": now} for r in requests]
        finally:
            with counting:
                running[0] -= len(requests)

    config = TritonConfig(
        http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port, allow_metrics=True
    )
    with Triton(config=config) as triton:
        triton.bind(
            model_name="sleep_ms",
            infer_func=sleep_then_echo,
            inputs=[Tensor(name="INPUT0", dtype=np.float32, shape=(-1,))],
            outputs=[Tensor(name="OUTPUT0", dtype=np.float32, shape=(-1,))],
            config=ModelConfig(
                max_batch_size=args.max_batch_size,
                batcher=DynamicBatcher(max_queue_delay_microseconds=2000) if args.dynamic_batching else None,
            ),
            strict=False,
        )
        typed = [("FP16", np.float16), ("INT64", np.int64), ("BOOL", np.bool_), ("BYTES", np.bytes_)]
        triton.bind(
            model_name="typed_echo",
            infer_func=typed_echo,
            inputs=[Tensor(name=f"IN_{name}", dtype=dtype, shape=(-1,)) for name, dtype in typed],
            outputs=[Tensor(name=f"OUT_{name}", dtype=dtype, shape=(-1,)) for name, dtype in typed],
            config=ModelConfig(
                max_batch_size=args.max_batch_size,
                batcher=DynamicBatcher(max_queue_delay_microseconds=2000) if args.dynamic_batching else None,
            ),
            strict=False,
        )
        triton.bind(
            model_name="count_up",
            infer_func=[count_up] * COUNT_UP_INSTANCES,  # instances: room for an over-commit to show
            inputs=[Tensor(name="INPUT0", dtype=np.float32, shape=(-1,))],
            outputs=[
                Tensor(name="OUTPUT0", dtype=np.float32, shape=(-1,)),
                Tensor(name="RUNNING", dtype=np.int32, shape=(1,)),
            ],
            config=ModelConfig(batching=False, decoupled=True),
            strict=False,
        )
        triton.serve()


if __name__ == "__main__":
    main()
