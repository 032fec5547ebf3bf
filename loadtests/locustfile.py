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
    print(retry_summary(RETRIES, time.monotonic() - STARTED))


def retry_summary(retries: list[tuple[float, bool, float]], run_s: float) -> str:
    """Per third of the run (not of the span retries happened in, which read "0- 0 s" when they all
    came in its first second): retries made after following the advice, and how many were refused."""
    if not retries:
        return "retries: none (no request was refused with advice)"
    refused = sum(again for _, again, _ in retries) / len(retries)
    lines = [f"retries: {len(retries)} over {run_s:.1f} s, refused again {refused:.0%}"]
    for third in range(3):
        start, end = third * run_s / 3, (third + 1) * run_s / 3
        part = [r for r in retries if start <= r[0] < end or (third == 2 and r[0] >= end)]
        if not part:
            lines.append(f"  {start:6.1f}-{end:6.1f} s: none")
            continue
        again = sum(a for _, a, _ in part) / len(part)
        advice = sorted(a for _, _, a in part)[len(part) // 2]
        lines.append(
            f"  {start:6.1f}-{end:6.1f} s: {len(part):5d}, refused again {again:4.0%}, "
            f"median advice followed {advice:.2f} s"
        )
    return "\n".join(lines)
