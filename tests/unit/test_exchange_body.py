"""A queued request holds its body once: in the wire prepared for its backend, not beside it."""

import json
from types import SimpleNamespace

import pytest

from gateway.settings import Backend, Model
from gateway.upstream.backends import BackendState, ModelPool
from gateway.upstream.exchange import Forwarder, UpstreamExchange, UpstreamRequest, serialized
from gateway.upstream.http1 import UpstreamClient

pytestmark = pytest.mark.anyio
BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 4096}]}).encode()


def backend(url: str, served: str | None = None) -> BackendState:
    model = Model(name="m", backends=[Backend(url=url, max_concurrency=1, served_model=served)])
    return BackendState.from_settings(model, model.backends[0])


def exchange(*backends: BackendState) -> UpstreamExchange:
    forwarder = Forwarder(
        UpstreamClient(), on_unreachable=lambda *_: None, observe_upstream_s=lambda *_: None
    )
    request = UpstreamRequest("POST", "/v1/chat/completions", b"", [], BODY, model_in_body=True)
    return UpstreamExchange(forwarder, ModelPool("m", list(backends)), request, None)


def test_the_body_is_held_only_in_the_wire_prepared_while_queued():
    only = backend("http://127.0.0.1:1")
    call = exchange(only)
    call.prepare()
    assert call._request is not None and call._request.body == b""
    assert call._wire(only).endswith(BODY)


def test_a_request_is_built_only_once_it_waits_or_starts_and_then_only_the_wire_holds_its_body():
    only = backend("http://127.0.0.1:1")
    built: list[UpstreamRequest] = []

    def build() -> UpstreamRequest:
        built.append(UpstreamRequest("POST", "/v1/chat/completions", b"", [], BODY, model_in_body=True))
        return built[-1]

    forwarder = exchange(only)._forwarder
    call = UpstreamExchange(forwarder, ModelPool("m", [only]), build, None)
    assert built == []  # refused now, it would cost nothing more
    call.prepare()
    call.prepare()
    assert len(built) == 1 and call._build_request is None
    assert call._request is not None and call._request.body == b""  # nothing but the wire holds the body
    assert call._wire(only) == serialized(built[0], only)


def test_a_wire_for_another_backend_takes_the_body_back_from_the_first():
    first, renamed, plain = (
        backend("http://127.0.0.1:1"),
        backend("http://127.0.0.1:2", "big"),
        backend("http://127.0.0.1:3"),
    )
    call = exchange(first)
    original = UpstreamRequest("POST", "/v1/chat/completions", b"", [], BODY, model_in_body=True)
    assert call._wire(renamed) == serialized(original, renamed)  # the served name written in
    assert json.loads(call._wire(renamed).split(b"\r\n\r\n", 1)[1])["model"] == "big"
    assert call._wire(plain) == serialized(original, plain)  # and the client's again
    assert call._wire(first) == serialized(original, first)


def test_with_several_backends_a_queued_request_is_built_and_left_for_its_grant_to_serialize():
    built: list[UpstreamRequest] = []

    def build() -> UpstreamRequest:
        built.append(UpstreamRequest("POST", "/v1/chat/completions", b"", [], BODY, model_in_body=True))
        return built[-1]

    first, second = backend("http://127.0.0.1:1"), backend("http://127.0.0.1:2", "big")
    call = UpstreamExchange(exchange(first)._forwarder, ModelPool("m", [first, second]), build, None)
    call.prepare()
    assert len(built) == 1 and call._prepared is None
    assert call._wire(second) == serialized(built[0], second)


async def test_the_slot_goes_back_even_when_reporting_the_backend_raises():
    """Whatever the bookkeeping of an ended exchange raises (marking a backend, a passive-health
    verdict), its `on_done` runs: the slot is never left held."""

    def unreachable(*_: object) -> None:
        raise RuntimeError("the health table broke")

    gone = backend("http://127.0.0.1:1")  # nothing listens: the connect fails
    forwarder = Forwarder(UpstreamClient(), on_unreachable=unreachable, observe_upstream_s=lambda *_: None)
    request = UpstreamRequest("POST", "/v2/models/m/infer", b"", [], b"{}")
    call = UpstreamExchange(forwarder, ModelPool("m", [gone]), request, None)
    done: list[float | None] = []
    call.on_done = done.append
    call.start_at_grant(SimpleNamespace(backend=gone))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="the health table broke"):
        await call.start()
    assert done == [None]
