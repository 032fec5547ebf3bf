"""SimApp: the simulated model server's HTTP surface, as a bare ASGI app (it must never be the bottleneck).

KServe v2 (JSON and binary tensors), OpenAI chat/completions/embeddings (SSE streaming with a
per-token delay), health, Triton/vLLM metrics, and /sim/stats, /sim/reset for tests and benchmarks;
/sim/fault makes its inference hang or fail while its health checks pass (gateway.tools.model_server.faults).

A client that goes away: by default the engine computes its request to the end, as Triton and
KServe servers do; with `stop_on_disconnect` it stops at once, as vLLM does.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import time
from typing import Any

from starlette.types import Receive, Scope, Send

from gateway.fields import decimal
from gateway.http.asgi_io import until_disconnect
from gateway.tools.model_server.chat import ContinuousChat
from gateway.tools.model_server.continuous import ContinuousEngine
from gateway.tools.model_server.engine import Job, SimEngine
from gateway.tools.model_server.exposition import render
from gateway.tools.model_server.faults import Fault, Faults
from gateway.tools.model_server.replies import reply, reply_json
from gateway.tools.model_server.tensors import TensorError, infer_response, parse_infer
from gateway.tools.model_server.tokens import prompt_tokens
from gateway.tools.model_server.vllm_metrics import VllmMetrics


async def _body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


class SimApp:
    def __init__(
        self,
        engine: SimEngine,
        *,
        default_tokens: int = 16,
        stop_on_disconnect: bool = False,
        continuous: ContinuousEngine | None = None,
        served_model_name: str = "sim",
    ) -> None:
        self.engine = engine
        self.default_tokens = default_tokens
        self.stop_on_disconnect = stop_on_disconnect
        self.faults = Faults()
        self.continuous = continuous
        self.chat = None if continuous is None else ContinuousChat(continuous, default_tokens=default_tokens)
        self.vllm_metrics = None if continuous is None else VllmMetrics(continuous.batch, served_model_name)
        self.priorities: collections.Counter[str] = collections.Counter()
        """The `priority` values inference requests carried (OpenAI's field, KServe's parameter),
        by their JSON text: what a gateway forwarded."""
        self.sequences: collections.Counter[str] = collections.Counter()
        self._ids = 0
        self.traceparents: collections.deque[str] = collections.deque(maxlen=64)
        """The `traceparent` of the last inference requests that carried one (a gateway's call)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path: str = scope["path"]
        method: str = scope["method"]
        if method == "POST" and (path.startswith("/v1/") or path.endswith("/infer")):
            faults = self.faults
            faults.received += 1
            for name, value in scope["headers"]:
                if name == b"traceparent":
                    self.traceparents.append(value.decode("latin-1"))
            if faults.applies_to(path):
                if not faults.fault.hang:
                    await _body(receive)
                    status = faults.fault.status or 500
                    await reply_json(send, status, {"error": f"sim fault: answering {status}"})
                    return
                answering, receive = await faults.hang(receive, until_disconnect=self.stop_on_disconnect)
                if not answering:
                    return  # its client left: nobody to answer
        if path.startswith("/v2/models/"):
            await self._v2_model(scope, receive, send, path.removeprefix("/v2/models/").split("/"), method)
        elif path in ("/v2/health/ready", "/v2/health/live", "/health"):
            await reply(send, 200, b"")
        elif path == "/v2":
            await reply_json(
                send, 200, {"name": "sim", "version": "2.51.0", "extensions": ["binary_tensor_data"]}
            )
        elif method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            await self._generate(receive, send, chat=path == "/v1/chat/completions")
        elif method == "POST" and path == "/v1/embeddings":
            await self._embeddings(receive, send)
        elif path == "/metrics":
            # A continuous engine is a vLLM server: its metrics are vLLM's alone.
            text = render(self.engine) if self.vllm_metrics is None else self.vllm_metrics.render()
            await reply(send, 200, text, b"text/plain; version=0.0.4")
        elif path == "/sim/stats":
            await reply_json(send, 200, self._stats())
        elif path == "/sim/reset" and method == "POST":
            self.engine.reset_peak()
            self.faults.reset_peak()
            await reply_json(send, 200, self._stats())
        elif path == "/sim/fault":
            await self._fault(receive, send, method)
        elif path == "/sim/speed" and method == "POST":
            await self._speed(receive, send)
        else:
            await reply_json(send, 404, {"error": f"no route for {method} {path}"})

    async def _fault(self, receive: Receive, send: Send, method: str) -> None:
        if method == "POST":
            try:
                self.faults.set(Fault.parse(await _body(receive)))
            except ValueError as error:
                await reply_json(send, 400, {"error": str(error)})
                return
        await reply_json(send, 200, self.faults.stats())

    async def _speed(self, receive: Receive, send: Send) -> None:
        """`{"slowdown": 2.0}`: the continuous engine's steps take twice as long from now on
        (another tenant on the GPU, a thermal limit)."""
        try:
            slowdown = float(json.loads(await _body(receive))["slowdown"])
            if self.continuous is None or not 0.01 <= slowdown <= 100:
                raise ValueError("slowdown must be within 0.01 .. 100, on a continuous engine")
        except (ValueError, KeyError, TypeError) as error:
            await reply_json(send, 400, {"error": str(error)})
            return
        self.continuous.slowdown = slowdown
        await reply_json(send, 200, {"slowdown": slowdown})

    def _stats(self) -> dict[str, Any]:
        stats = self.engine.stats
        gaps = sorted(stats.idle_gaps_s)
        return {
            "idle_gap_ms": {
                f"p{q}": round(gaps[min(len(gaps) - 1, len(gaps) * q // 100)] * 1000, 3) if gaps else None
                for q in (50, 90, 99)
            },
            "slots": self.engine.slots,
            "inflight": stats.inflight,
            "peak_inflight": stats.peak_inflight,
            "running": stats.running,
            "completed": stats.completed,
            "stopped": stats.stopped,
            "busy_slot_s": stats.busy_slot_s,
            "faults": self.faults.stats(),
            "priorities": dict(self.priorities),
            "sequences": dict(self.sequences),
            "traceparents": list(self.traceparents),
            **({} if self.continuous is None else {"continuous": _continuous_stats(self.continuous)}),
        }

    async def _v2_model(
        self, scope: Scope, receive: Receive, send: Send, parts: list[str], method: str
    ) -> None:
        model, rest, version = parts[0], parts[1:], "1"
        if rest[:1] == ["versions"] and len(rest) >= 2:
            version, rest = rest[1], rest[2:]
        if rest == ["infer"] and method == "POST":
            await self._infer(scope, receive, send, model, version)
        elif rest == [] and method == "GET":
            tensor = {"datatype": "FP32", "shape": [-1, -1]}
            await reply_json(
                send,
                200,
                {
                    "name": model,
                    "versions": ["1"],
                    "platform": "sim",
                    "inputs": [{"name": "INPUT0", **tensor}],
                    "outputs": [{"name": "OUTPUT0", **tensor}],
                },
            )
        elif rest == ["ready"] and method == "GET":
            await reply(send, 200, b"")
        elif rest == ["config"] and method == "GET":
            await reply_json(
                send,
                200,
                {
                    "name": model,
                    "platform": "sim",
                    "max_batch_size": 0,
                    "instance_group": [{"count": self.engine.slots, "kind": "KIND_CPU"}],
                },
            )
        else:
            await reply_json(send, 404, {"error": f"no route for {method} {scope['path']}"})

    async def _infer(self, scope: Scope, receive: Receive, send: Send, model: str, version: str) -> None:
        body = await _body(receive)
        header_length = None
        for key, value in scope["headers"]:
            if key == b"inference-header-content-length":
                length = decimal(value)
                header_length = -1 if length is None else length
        try:
            request = parse_infer(body, header_length)
        except TensorError as error:
            await reply_json(send, 400, {"error": str(error)})
            return
        if "priority" in request.parameters:
            self.priorities[json.dumps(request.parameters["priority"])] += 1
        if "sequence_id" in request.parameters:  # what a gateway sent this instance, for its tests
            self.sequences[str(request.parameters["sequence_id"])] += 1
        if not await self._compute(receive, model, self.engine.service.batch_s(request.batch), request.batch):
            return
        answer, json_length = infer_response(model, version, request)
        if json_length is None:
            await reply(send, 200, answer)
        else:
            await reply(
                send,
                200,
                answer,
                b"application/octet-stream",
                [(b"inference-header-content-length", str(json_length).encode())],
            )

    async def _generate(self, receive: Receive, send: Send, *, chat: bool) -> None:
        try:
            request = json.loads(await _body(receive))
            model = request["model"]
            tokens = int(
                request.get("max_completion_tokens") or request.get("max_tokens") or self.default_tokens
            )
        except (ValueError, KeyError, TypeError):
            await reply_json(
                send,
                400,
                {"error": {"message": "need a JSON body with 'model'", "type": "invalid_request_error"}},
            )
            return
        tokens = max(1, min(tokens, 4096))
        self._ids += 1
        ident = f"{'chatcmpl' if chat else 'cmpl'}-sim-{self._ids}"
        if isinstance(request, dict) and "priority" in request:
            self.priorities[json.dumps(request["priority"])] += 1
        if self.chat is not None:
            await self.chat.serve(request, ident, receive, send, chat=chat)
            return
        service = self.engine.service
        if request.get("stream") is True:
            await self._stream(receive, send, model, ident, tokens, chat=chat)
            return
        if not await self._compute(receive, model, service.base_s() + tokens * service.token_ms / 1000, 1):
            return
        text = " ".join(f"tok{i}" for i in range(tokens))
        choice: dict[str, Any] = {"index": 0, "finish_reason": "length"}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        await reply_json(
            send,
            200,
            {
                "id": ident,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": model,
                "choices": [choice],
                "usage": {
                    "prompt_tokens": (prompt := prompt_tokens(request, chat=chat)),
                    "completion_tokens": tokens,
                    "total_tokens": prompt + tokens,
                },
            },
        )

    async def _stream(
        self, receive: Receive, send: Send, model: str, ident: str, tokens: int, *, chat: bool
    ) -> None:
        """Tokens as server-sent events."""
        engine = self.engine
        service = engine.service
        job = engine.submit(model)
        watch = self._watch(receive, job)
        created = int(time.time())
        try:
            if not await engine.run(job, service.base_s()):
                return
            await send(
                {
                    "type": "http.response.start",
                    "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
                }
            )
            for i in range(tokens):
                if i and not await engine.run(job, service.token_ms / 1000):
                    return
                last = i == tokens - 1
                piece = f"tok{i}" + ("" if last else " ")
                choice: dict[str, Any] = {"index": 0, "finish_reason": "length" if last else None}
                if chat:
                    choice["delta"] = {"content": piece}
                else:
                    choice["text"] = piece
                chunk = {
                    "id": ident,
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created,
                    "model": model,
                    "choices": [choice],
                }
                await send(
                    {
                        "type": "http.response.body",
                        "body": b"data: " + json.dumps(chunk).encode() + b"\n\n",
                        "more_body": True,
                    }
                )
        finally:
            if watch is not None:
                watch.cancel()
            engine.end(job, 1)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    async def _compute(self, receive: Receive, model: str, seconds: float, items: int) -> bool:
        """Hold a slot for `seconds`; False when the request was stopped (its client is gone)."""
        job = self.engine.submit(model)
        watch = self._watch(receive, job)
        try:
            return await self.engine.run(job, seconds)
        finally:
            if watch is not None:
                watch.cancel()
            self.engine.end(job, items)

    def _watch(self, receive: Receive, job: Job) -> asyncio.Task[None] | None:
        """In stop-on-disconnect mode: stop `job` in the very step that sees its client leave, so
        its slot is free before any request that follows can reach the engine."""
        if not self.stop_on_disconnect:
            return None

        async def stop_when_gone() -> None:
            await until_disconnect(receive)
            self.engine.stop(job)

        return asyncio.ensure_future(stop_when_gone())

    async def _embeddings(self, receive: Receive, send: Send) -> None:
        try:
            request = json.loads(await _body(receive))
            model = request["model"]
            items = request["input"] if isinstance(request["input"], list) else [request["input"]]
        except (ValueError, KeyError, TypeError):
            await reply_json(
                send, 400, {"error": {"message": "need 'model' and 'input'", "type": "invalid_request_error"}}
            )
            return
        if not await self._compute(receive, model, self.engine.service.batch_s(len(items)), len(items)):
            return
        data = [
            {"object": "embedding", "index": i, "embedding": _vector(str(item))}
            for i, item in enumerate(items)
        ]
        await reply_json(
            send,
            200,
            {
                "object": "list",
                "data": data,
                "model": model,
                "usage": {"prompt_tokens": len(items), "total_tokens": len(items)},
            },
        )


def _continuous_stats(engine: ContinuousEngine) -> dict[str, Any]:
    batch = engine.batch
    return {
        "max_num_seqs": batch.spec.max_num_seqs,
        "running": len(batch.running),
        "waiting": len(batch.waiting),
        "kv_used": batch.kv_used,
        "kv_tokens": batch.spec.kv_tokens,
        "preemptions": batch.counters.preemptions,
        "generation_tokens": batch.counters.generation_tokens,
        "slowdown": engine.slowdown,
    }


def _vector(text: str) -> list[float]:
    digest = hashlib.sha256(text.encode()).digest()
    return [round(b / 255.0, 4) for b in digest[:8]]
