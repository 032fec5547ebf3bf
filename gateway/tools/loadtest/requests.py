"""The request each traffic entry sends, built once per entry: an HTTP path, body and headers, or a
gRPC `ModelInferRequest` (gateway/tools/loadtest/grpc_calls.py) with the headers as metadata."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from gateway.tools.loadtest.workload import Traffic

_WORDS = ("the", "gateway", "queues", "requests", "for", "a", "model", "server", "with", "few", "slots")


@dataclass(frozen=True, slots=True)
class Prepared:
    path: str
    body: bytes
    headers: dict[str, str]
    stream: bool
    deadline_s: float
    rpc: Any = None
    """A gRPC `ModelInferRequest`, sent instead of the HTTP body (kind `grpc`)."""

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Its headers as gRPC metadata (lower-case keys; no content type)."""
        return tuple((k.lower(), v) for k, v in self.headers.items() if k.lower() != "content-type")

    def retry(self, attempt: int) -> Prepared:
        """The same request sent again, saying so (the gateway counts retries: gateway_retries_total)."""
        return replace(self, headers={**self.headers, "X-Retry-Attempt": str(attempt)})


def prepare(traffic: Traffic, model: str) -> Prepared:
    """The request `traffic` sends to `model`: KServe v2 infer, or OpenAI chat or completion."""
    headers = {"Content-Type": "application/json", "X-Request-Timeout-Ms": f"{traffic.deadline_ms:g}"}
    if traffic.priority is not None:
        headers["X-Priority"] = traffic.priority
    if traffic.tenant is not None:
        headers["X-Tenant"] = traffic.tenant
    if traffic.api_key is not None:
        headers["Authorization"] = f"Bearer {traffic.api_key}"
    headers.update(traffic.headers)
    if traffic.kind == "grpc":
        from gateway.tools.loadtest.grpc_calls import infer_request  # grpcio only where it is used

        body = dict(traffic.body) if traffic.body is not None else _tensor_body(traffic.size)
        return Prepared("", b"", headers, False, traffic.deadline_ms / 1000, infer_request(model, body))
    if traffic.kind == "infer":
        path = f"/v2/models/{model}/infer"
        body = dict(traffic.body) if traffic.body is not None else _tensor_body(traffic.size)
    else:
        path = "/v1/chat/completions" if traffic.kind == "chat" else "/v1/completions"
        body = dict(traffic.body) if traffic.body is not None else _openai_body(traffic)
        body.setdefault("model", model)
        if traffic.stream:
            body["stream"] = True
    return Prepared(path, json.dumps(body).encode(), headers, traffic.stream, traffic.deadline_ms / 1000)


def _tensor_body(size: int) -> dict[str, object]:
    data = [float(i % 7) for i in range(size)]
    return {"inputs": [{"name": "INPUT0", "shape": [1, size], "datatype": "FP32", "data": data}]}


def _openai_body(traffic: Traffic) -> dict[str, object]:
    prompt = " ".join(_WORDS[i % len(_WORDS)] for i in range(traffic.prompt_words))
    body: dict[str, object] = {"max_tokens": traffic.size}
    if traffic.kind == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body
