"""Closed-loop load with well-behaved clients, for SLO tuning: users that honour Retry-After.

    inference-gateway demo &   # or serve your own config
    locust -f loadtests/locustfile.py --host http://127.0.0.1:8080 --headless -u 60 -r 20 -t 60s

Interactive users send `high` requests with a 250 ms budget, batch users `low` ones with 1 s; a
refused user waits what the gateway advised (`retry-after-ms`, else `Retry-After`) before its next
request, as OpenAI-style clients do. Locust's report then shows how many requests each class got
through and how often retries were refused again: a measure of how honest the advice is.
Environment: MODEL (default sim).
"""

from __future__ import annotations

import os
import time

from locust import HttpUser, between, events, task

MODEL = os.environ.get("MODEL", "sim")
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
STARTED = time.monotonic()
# (seconds into the run, refused again?, the advice that was followed) for every retry
RETRIES: list[tuple[float, bool, float]] = []


class GatewayUser(HttpUser):
    abstract = True
    priority = "low"
    budget_ms = 1000
    retry_at = 0.0
    advice_s: float | None = None

    def infer(self) -> None:
        if time.monotonic() < self.retry_at:
            return
        headers = {"X-Priority": self.priority, "X-Request-Timeout-Ms": str(self.budget_ms)}
        with self.client.post(
            f"/v2/models/{MODEL}/infer",
            json=INFER,
            headers=headers,
            name=f"infer {self.priority}",
            catch_response=True,
        ) as reply:
            if self.advice_s is not None:
                RETRIES.append((time.monotonic() - STARTED, reply.status_code == 429, self.advice_s))
                self.advice_s = None
            if reply.status_code == 429:
                advice_ms = reply.headers.get("retry-after-ms")
                self.advice_s = (
                    int(advice_ms) / 1000 if advice_ms else int(reply.headers.get("Retry-After", "1"))
                )
                self.retry_at = time.monotonic() + self.advice_s
                reply.failure(f"429 {reply.json().get('reason')}")
            elif reply.status_code != 200:
                reply.failure(f"{reply.status_code}")


class InteractiveUser(GatewayUser):
    weight = 1
    priority = "high"
    budget_ms = 250
    wait_time = between(0.05, 0.2)

    @task
    def ask(self) -> None:
        self.infer()


class BatchUser(GatewayUser):
    weight = 4
    priority = "low"
    budget_ms = 1000
    wait_time = between(0.0, 0.05)

    @task
    def submit(self) -> None:
        self.infer()


@events.quitting.add_listener
def report_retries(environment, **_kwargs) -> None:  # type: ignore[no-untyped-def]
    """Per third of the run: retries made after following the advice, and how many were refused."""
    if not RETRIES:
        return
    end = max(at for at, _, _ in RETRIES)
    for third in range(3):
        part = [r for r in RETRIES if third * end / 3 <= r[0] <= (third + 1) * end / 3]
        if part:
            refused = sum(again for _, again, _ in part) / len(part)
            advice = sorted(a for _, _, a in part)[len(part) // 2]
            print(
                f"retries {third * end / 3:5.0f}-{(third + 1) * end / 3:4.0f} s: {len(part):5d}, "
                f"refused again {refused:4.0%}, median advice followed {advice:.2f} s"
            )
