"""A batch round that cannot start (a merge, a metrics call or the exchange raises in the loop
callback that starts it) answers each member and frees the slot: nothing waits for it."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from gateway.errors import ErrorStyle
from gateway.flow.admitted import Admission, AdmittedCall, RequestMeta
from gateway.flow.batch_calls import Batches
from gateway.flow.controller import AdmissionController
from gateway.flow.drain import Drain
from gateway.http.batches import BatchRelay
from gateway.queues.base import Batching, Slot
from gateway.queues.memory.store import MemoryQueue
from gateway.settings import Estimation, PriorityClass
from gateway.telemetry.metrics import GatewayMetrics
from gateway.tensors.batch import part_of
from gateway.upstream.backends import BackendState, ModelPool
from gateway.upstream.exchange import Forwarder, UpstreamRequest
from gateway.upstream.http1 import UpstreamClient
from policies.outcomes import Outcome
from tests.eventually import eventually

pytestmark = pytest.mark.anyio
META = RequestMeta(priority="low", band=0, tenant=None, budget_s=None)
PATH = "/v2/models/m/infer"
BODY = json.dumps({"inputs": [{"name": "x", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}).encode()


class BrokenBatchMetrics(GatewayMetrics):
    broken = False

    def observe_batch(self, model: str, items: float) -> None:
        if self.broken:
            raise RuntimeError("observe_batch broke")
        super().observe_batch(model, items)


class Holder:
    """A request's work that holds the slot until `finish`."""

    on_done: Any = None

    def prepare(self) -> None: ...

    def start_at_grant(self, slot: Slot) -> None: ...

    def close(self) -> bool:
        return True

    def finish(self) -> None:
        self.on_done(0.04)


class Answered:
    async def until_disconnect(self) -> None:
        await asyncio.Event().wait()

    async def answer(self, lease: object) -> Outcome:
        return Outcome.OK

    async def refuse(self, refusal: object) -> None: ...


async def test_a_round_that_cannot_start_answers_its_members_and_frees_the_slot(caplog):
    caplog.set_level(logging.CRITICAL)
    pool = ModelPool("m", [BackendState("m", "http://127.0.0.1:9", 1, "/", ready=True)], 0.04)
    store = MemoryQueue([pool], 1, Estimation())
    metrics = BrokenBatchMetrics(CollectorRegistry())
    controller = AdmissionController(store, [PriorityClass(name="low", max_wait_ms=5000)], metrics)
    admission = Admission(controller, metrics, Drain(), no_backend_retry_s=1.0)
    forwarder = Forwarder(
        UpstreamClient(), on_unreachable=lambda pool, backend: None, observe_upstream_s=lambda *args: None
    )
    batches = Batches(forwarder, metrics, 1.0)
    holder = Holder()
    await AdmittedCall(admission, pool, META, holder, Answered()).run()  # holds the only slot
    part = part_of(PATH, BODY, None)
    statuses: list[int] = []
    calls = []
    for _ in range(2):
        member = batches.member(pool, UpstreamRequest("POST", PATH, b"", [], BODY), part, None)

        async def receive() -> dict[str, Any]:
            await asyncio.Event().wait()  # the client stays
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        relay = BatchRelay(receive, send, ErrorStyle.KSERVE, member, admission.drain, 1.0)
        call = AdmittedCall(
            admission,
            pool,
            META,
            member,
            relay,
            body_bytes=len(BODY),
            cost=1.0,
            batching=Batching(part.key, 8.0),
        )
        calls.append(asyncio.ensure_future(call.run()))
    await eventually(lambda: store.stats("m").queued_by_band == (2,), what="both members queued")
    metrics.broken = True
    holder.finish()  # the slot goes to the two members as one round, whose start raises
    await asyncio.wait_for(asyncio.gather(*calls), 5)
    assert statuses == [502, 502]
    assert (store.stats("m").free_slots, pool.backends[0].inflight) == (1, 0)
