"""`inference.GRPCInferenceService` as Triton defines it (the stubs `tritonclient.grpc` ships).

- `ServerLive`, `ServerReady`, `ModelReady` and `ServerMetadata` answer from the gateway's view of
  the pool, as the HTTP `/v2/health/*` routes do (ready is false while the gateway drains);
- `ModelMetadata` and `ModelConfig` are asked of a ready backend over HTTP and translated, no slot
  taken (gateway.http.kserve's passthrough);
- `ModelInfer` and each message of `ModelStreamInfer` go through admission
  (gateway.grpc.inference). A unary refusal is sent Trailers-Only, its code and pushback from
  gateway.grpc.status; on a stream each request is admitted on its own, may go to its own
  backend, and one that fails is answered in-band (`error_message`, with `reason` and
  `retry_after_ms` among the response's parameters) while the stream stays open; a decoupled
  model's request gets each response its backend streams (gateway.grpc.streamed);
- every other method answers UNIMPLEMENTED, saying so.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any
from urllib.parse import quote

from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc

import grpc
from gateway.flow.readiness import Readiness
from gateway.flow.request_meta import Problem, RequestClassifier
from gateway.grpc.answer import backend_message
from gateway.grpc.inference import Answered, GrpcInference, metadata_headers
from gateway.grpc.status import Code, GrpcError, backend_code, outcome_error
from gateway.grpc.streamed import in_band
from gateway.upstream.backends import ModelPool
from gateway.upstream.exchange import Forwarder, UpstreamRequest
from gateway.upstream.reply import UpstreamError
from policies.outcomes import Outcome

log = logging.getLogger("gateway.grpc")

SERVER_NAME = "inference-gateway"

Context = grpc.aio.ServicerContext[Any, Any]


class InferenceService(service_pb2_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    def __init__(
        self,
        inference: GrpcInference,
        pools: Mapping[str, ModelPool],
        classifier: RequestClassifier,
        forwarder: Forwarder,
        readiness: Readiness,
        *,
        version: str,
        no_backend_retry_s: float,
    ) -> None:
        self._inference = inference
        self._pools = pools
        self._classifier = classifier
        self._forwarder = forwarder
        self._readiness = readiness
        self._version = version
        self._no_backend_retry_s = no_backend_retry_s

    async def ServerLive(self, request: Any, context: Context) -> Any:
        return service_pb2.ServerLiveResponse(live=True)

    async def ServerReady(self, request: Any, context: Context) -> Any:
        return service_pb2.ServerReadyResponse(ready=self._readiness.ready)

    async def ServerMetadata(self, request: Any, context: Context) -> Any:
        return service_pb2.ServerMetadataResponse(name=SERVER_NAME, version=self._version)

    async def ModelReady(self, request: Any, context: Context) -> Any:
        pool = await self._model(request.name, context)
        ready = pool.any_ready and not self._readiness.draining
        return service_pb2.ModelReadyResponse(ready=ready)

    async def ModelMetadata(self, request: Any, context: Context) -> Any:
        document = await self._ask_backend(request.name, request.version, "", context)
        response = service_pb2.ModelMetadataResponse()
        json_format.ParseDict(document, response, ignore_unknown_fields=True)
        return response

    async def ModelConfig(self, request: Any, context: Context) -> Any:
        document = await self._ask_backend(request.name, request.version, "/config", context)
        response = service_pb2.ModelConfigResponse()
        try:
            json_format.ParseDict(document, response.config, ignore_unknown_fields=True)
        except json_format.ParseError as error:
            await context.abort(Code.INTERNAL, f"the backend's model config does not parse: {error}")
        return response

    async def ModelInfer(self, request: Any, context: Context) -> Any:
        headers = metadata_headers(context.invocation_metadata())
        answered = await self._inference.infer(request, headers, context.time_remaining())
        result = answered.result
        if isinstance(result, GrpcError):
            # Nothing was sent before: the status goes Trailers-Only, which retry policies act on.
            await context.abort(result.code, result.message, result.trailers + answered.trailers)
        if answered.trailers:
            context.set_trailing_metadata(answered.trailers)
        return result

    async def ModelStreamInfer(self, requests: Any, context: Context) -> None:
        headers = metadata_headers(context.invocation_metadata())
        writing = asyncio.Lock()

        async def write(response: Any) -> None:
            async with writing:
                await context.write(response)

        async def one(request: Any) -> None:
            try:
                answered = await self._inference.infer(request, headers, context.time_remaining(), write)
            except Exception:  # one request's failure must not end the others' stream
                log.exception("a stream's inference failed")
                answered = Answered(GrpcError(Code.INTERNAL, "the gateway failed the request"))
            if not answered.written:
                await write(stream_response(request, answered))

        async with asyncio.TaskGroup() as inferences:
            async for request in requests:
                inferences.create_task(one(request))

    async def _model(self, name: str, context: Context) -> ModelPool:
        """The model's pool, once the caller's key is checked (before the name, as over HTTP)."""
        checked = self._classifier.classify(metadata_headers(context.invocation_metadata()))
        if isinstance(checked, Problem):
            error = outcome_error(checked.outcome, detail=checked.detail)
            await context.abort(error.code, error.message, error.trailers)
        pool = self._pools.get(name)
        if pool is None:
            error = outcome_error(Outcome.UNKNOWN_MODEL, detail=repr(name))
            await context.abort(error.code, error.message, error.trailers)
        assert pool is not None  # abort raised otherwise
        return pool

    async def _ask_backend(self, name: str, version: str, suffix: str, context: Context) -> dict[str, Any]:
        """A ready backend's JSON answer to GET /v2/models/{name}[/versions/{v}]{suffix}."""
        pool = await self._model(name, context)
        backend = next((b for b in pool.backends if b.ready), None)
        if backend is None:
            error = outcome_error(Outcome.NO_BACKEND, retry_after_s=self._no_backend_retry_s)
            await context.abort(error.code, error.message, error.trailers)
        assert backend is not None
        path = "/v2/models/" + quote(name, safe="")
        if version:
            path += "/versions/" + quote(version, safe="")
        request = UpstreamRequest("GET", path + suffix, b"", [], b"")
        try:
            reply, body = await self._forwarder.fetch(pool, backend, request)
        except TimeoutError:
            await context.abort(Code.DEADLINE_EXCEEDED, "the backend did not answer in time")
        except UpstreamError as error:
            await context.abort(Code.UNAVAILABLE, f"the backend failed to answer: {type(error).__name__}")
        if reply.status >= 400:
            await context.abort(backend_code(reply.status), backend_message(body))
        try:
            document = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError):
            document = None
        if not isinstance(document, dict):
            await context.abort(Code.INTERNAL, "the backend's answer is not a JSON object")
        assert isinstance(document, dict)  # abort raised otherwise
        return document


_NO_SHARED_MEMORY = "shared memory is local to one server, and the gateway sends tensors over the network"
_UNSERVED = {
    "ModelStatistics": "read the gateway's /metrics, or each backend's",
    "RepositoryIndex": "the gateway's models are its config's",
    "RepositoryModelLoad": "load models on the backends",
    "RepositoryModelUnload": "unload models on the backends",
    "SystemSharedMemoryStatus": _NO_SHARED_MEMORY,
    "SystemSharedMemoryRegister": _NO_SHARED_MEMORY,
    "SystemSharedMemoryUnregister": _NO_SHARED_MEMORY,
    "CudaSharedMemoryStatus": _NO_SHARED_MEMORY,
    "CudaSharedMemoryRegister": _NO_SHARED_MEMORY,
    "CudaSharedMemoryUnregister": _NO_SHARED_MEMORY,
    "TraceSetting": "set tracing on the backends",
    "LogSettings": "set logging on the backends",
}
"""The service's other methods, and what to do instead: each answers UNIMPLEMENTED, saying so."""


def _unserved(method: str, instead: str) -> Callable[..., Awaitable[None]]:
    async def unserved(self: InferenceService, request: Any, context: Context) -> None:
        await context.abort(Code.UNIMPLEMENTED, f"the gateway does not serve {method}: {instead}")

    unserved.__name__ = unserved.__qualname__ = method
    return unserved


for _method, _instead in _UNSERVED.items():
    setattr(InferenceService, _method, _unserved(_method, _instead))


def stream_response(request: Any, answered: Answered) -> Any:
    """A stream's answer to `request`: its response, or its error in-band (the stream stays open)."""
    result = answered.result
    if not isinstance(result, GrpcError):
        return service_pb2.ModelStreamInferResponse(infer_response=result)
    return in_band(request, result)
