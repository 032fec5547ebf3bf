"""Every route the gateway serves, with each method it takes, without a key, with a wrong key and
with the right one: against a gateway without tenants, one with tenants, and one with tenants and
an admin listener (whose operator routes leave the client port, and which serves nothing else).

The routes are read from the app itself (the Starlette routes of `create_app` and the inference
routes `InferenceRoutes` serves in front of them), so a route added later is swept too. With
tenants configured, a route either wants the key, checked before it says whether the model exists
(401 in the route's style, the same for a real and a made-up model), or is one of the routes below
that are open on purpose; adding an open route means adding it there, with the reason.
"""

from __future__ import annotations

import http.client
import json
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest
from starlette.routing import Route

from gateway.http.hot_routes import INFER_ROUTES, OPENAI_PATHS, v2_infer_params
from gateway.http.kserve import ModelPassthrough
from gateway.programs.app import create_app
from gateway.settings import Settings, parse_settings
from tests.integration.servers import gateway_config

OPEN_ROUTES = {
    "/healthz": "kubelet's liveness probe carries no key",
    "/health": "load testers probe the serving port before a run: liveness, nothing about the models",
    "/readyz": "kubelet's readiness probe carries no key (on the admin listener with admin_listen)",
    "/metrics": "Prometheus scrapes without a tenant key (on the admin listener with admin_listen)",
    "/v2/health/live": "KServe v2 server liveness: one boolean, no model, probed before any call",
    "/v2/health/ready": "KServe v2 server readiness: one boolean, no model, probed before any call",
    "/v2": "KServe v2 server metadata: the gateway's name and version, nothing about the models",
    "/status": "the operators' page, where /metrics is (on the admin listener with admin_listen)",
    "/status.json": "the operators' page as JSON, where /metrics is",
    "/status/stream": "the operators' page as a stream, where /metrics is",
}
"""Routes a caller without a key may use with tenants configured, and why: none names a model."""

KEY = "gold-key-0123456789"
TENANTS = [{"name": "gold", "api_keys": [KEY]}]
NO_KEY: dict[str, str] = {}
WRONG_KEY = {"Authorization": "Bearer wrong-key-0123456789"}
RIGHT_KEY = {"Authorization": f"Bearer {KEY}"}
METHODS = ("GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS")
KNOWN, UNKNOWN = "sim", "no-such-model"
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 1], "datatype": "FP32", "data": [1]}]}
_PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")


@dataclass(frozen=True, slots=True)
class Served:
    """One route as the app serves it: its template and the methods it takes."""

    template: str
    methods: frozenset[str]
    forwarded: bool = False
    """Passed through to a backend without a slot (model metadata, config, readiness)."""

    @property
    def model_in(self) -> str | None:
        """Where a request to it names its model: "path", "body" (OpenAI inference) or None."""
        if "{model" in self.template:
            return "path"
        return "body" if self.template in OPENAI_PATHS else None

    def path(self, model: str | None) -> str:
        def fill(match: re.Match[str]) -> str:
            name = match.group(1)
            if name == "model" and model is not None:
                return model
            if name == "version":
                return "1"
            if name == "request_id":
                return "no-such-request"
            raise AssertionError(f"the sweep cannot fill {{{name}}} in {self.template}: teach it")

        return _PARAM.sub(fill, self.template)


def served_routes(settings: Settings) -> list[Served]:
    """Every route of the client listener of the gateway `create_app(settings)` builds, its
    inference routes included."""
    app = create_app(settings)
    client = getattr(app, "client", app)  # with admin_listen, the app serves the client's app apart
    unknown = [route for route in client.routes if not isinstance(route, Route)]
    assert not unknown, f"the sweep knows only plain routes, not {unknown}: teach it"
    routes = [
        Served(route.path, frozenset(route.methods or ()), isinstance(route.endpoint, ModelPassthrough))
        for route in client.routes
    ]
    inference = [*INFER_ROUTES, *sorted(OPENAI_PATHS)]
    return routes + [Served(template, frozenset({"POST"})) for template in inference]


def _config(backend_url: str, *, tenants: bool = True, admin: bool = False) -> dict[str, Any]:
    config = gateway_config([(backend_url, 4)], tenants=TENANTS if tenants else [])
    if admin:
        config["admin_listen"] = {"host": "127.0.0.1", "port": 0}
    return config


ROUTES = served_routes(parse_settings(_config("http://127.0.0.1:9")))
CLIENT_ROUTES = served_routes(parse_settings(_config("http://127.0.0.1:9", admin=True)))
"""The client listener's routes when an admin listener is configured."""
ADMIN_ROUTES = [route for route in ROUTES if route not in CLIENT_ROUTES]
"""The routes that move to the admin listener."""


def route_id(route: Served) -> str:
    return route.template


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes
    content_length: str | None = None

    def reason(self, path: str) -> str | None:
        """The machine-readable reason of a gateway error in the route's style, else None."""
        try:
            payload = json.loads(self.body)
        except ValueError:
            return None
        error = payload.get("error") if isinstance(payload, dict) else None
        if path.startswith("/v1/"):
            return error.get("code") if isinstance(error, dict) and error.get("message") else None
        return payload.get("reason") if isinstance(error, str) and error else None


def request(base_url: str, method: str, route: Served, model: str | None, headers: dict[str, str]) -> Answer:
    path = route.path(model if route.model_in == "path" else None)
    body: bytes | None = None
    if method == "POST":
        if route.model_in == "body":
            openai = {"model": model, "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}
            body = json.dumps({**openai, "input": "hi", "max_tokens": 1}).encode()
        else:
            body = json.dumps(INFER).encode()
    parts = urlsplit(base_url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        connection.request(method, path, body=body, headers={**headers, "Content-Type": "application/json"})
        reply = connection.getresponse()
        if reply.status == 200 and reply.getheader("content-type", "").startswith("text/event-stream"):
            return Answer(reply.status, reply.read1(), None)  # an endless stream: its first event
        return Answer(reply.status, reply.read(), reply.getheader("content-length"))
    finally:
        connection.close()


def models_of(route: Served) -> list[str | None]:
    return [KNOWN, UNKNOWN] if route.model_in else [None]


@pytest.fixture(scope="module")
def sim(module_launcher):
    return module_launcher.sim(slots=4, base_ms=1)


@pytest.fixture(scope="module")
def gateways(module_launcher, sim):
    """Without tenants, with tenants, and with tenants and an admin listener."""
    return (
        module_launcher.gateway(_config(sim.url, tenants=False)),
        module_launcher.gateway(_config(sim.url)),
        module_launcher.gateway(_config(sim.url, admin=True)),
    )


def test_the_sweep_sees_every_kind_of_route():
    templates = {route.template for route in ROUTES}
    assert set(OPEN_ROUTES) <= templates, f"open routes the gateway no longer serves: {OPEN_ROUTES}"
    for template in INFER_ROUTES:  # the listing is the matcher's, not a copy that drifted
        assert v2_infer_params(Served(template, frozenset()).path(KNOWN)) is not None, template
    assert {route.model_in for route in ROUTES} == {"path", "body", None}
    assert {route.template for route in ADMIN_ROUTES} == {
        "/healthz", "/readyz", "/metrics", "/status", "/status.json", "/status/stream"
    }  # fmt: skip
    assert set(CLIENT_ROUTES) <= set(ROUTES)


def keyed_expectation(route: Served, method: str, unkeyed: Answer, answer: Answer, where: str) -> None:
    """A caller without a valid key gets 401 in the route's style, unless the route is open."""
    if route.template in OPEN_ROUTES:
        assert answer.status == unkeyed.status, f"{where} is open: {answer}"
    elif method == "HEAD":
        assert answer.status == 401, f"{where}: {answer}"
    else:
        assert (answer.status, answer.reason(route.template)) == (401, "unauthorized"), f"{where}: {answer}"


@pytest.mark.parametrize("route", ROUTES, ids=route_id)
def test_with_tenants_a_route_refuses_a_caller_without_a_valid_key_unless_open(gateways, route):
    open_gateway, keyed_gateway, admin_gateway = gateways
    keyed = [keyed_gateway.url] + ([admin_gateway.url] if route in CLIENT_ROUTES else [])
    for method in sorted(route.methods):
        for model in models_of(route):
            unkeyed = request(open_gateway.url, method, route, model, NO_KEY)
            for url in keyed:
                where = f"{method} {url}{route.path(model)} (model {model})"
                answer = request(url, method, route, model, RIGHT_KEY)
                assert answer.status == unkeyed.status != 401, f"{where}: with the key, as without tenants"
                for headers in (NO_KEY, WRONG_KEY):
                    answer = request(url, method, route, model, headers)
                    keyed_expectation(route, method, unkeyed, answer, f"{where} {headers}")


@pytest.mark.parametrize("route", ROUTES, ids=route_id)
def test_without_tenants_every_route_serves_whatever_the_authorization(gateways, route):
    open_gateway = gateways[0]
    for method in sorted(route.methods - {"HEAD"}):
        for model in models_of(route):
            where = f"{method} {route.path(model)} (model {model})"
            for headers in (NO_KEY, WRONG_KEY):
                answer = request(open_gateway.url, method, route, model, headers)
                if model == UNKNOWN:
                    assert (answer.status, answer.reason(route.template)) == (404, "unknown_model"), where
                elif route.template == "/status/requests/{request_id}":  # served: no such request queued
                    assert (answer.status, answer.reason(route.template)) == (404, "not_queued"), where
                else:
                    assert answer.status == 200, f"{where} {headers}: {answer}"


@pytest.mark.parametrize("route", ROUTES, ids=route_id)
def test_a_method_a_route_does_not_take_is_405_whatever_the_key_and_model(gateways, route):
    """405 says only that the route exists, never whether the model does."""
    for gateway in gateways[:2]:
        for method in sorted(set(METHODS) - route.methods):
            for model in models_of(route):
                for headers in (NO_KEY, WRONG_KEY, RIGHT_KEY):
                    answer = request(gateway.url, method, route, model, headers)
                    assert answer.status == 405, f"{method} {route.path(model)} {headers}: {answer}"


@pytest.mark.parametrize("route", ADMIN_ROUTES, ids=route_id)
def test_with_an_admin_listener_an_operator_route_is_open_there_and_gone_from_the_client_port(
    gateways, route
):
    admin_gateway = gateways[2]
    assert admin_gateway.admin_url != admin_gateway.url
    for headers in (NO_KEY, WRONG_KEY, RIGHT_KEY):
        assert request(admin_gateway.admin_url, "GET", route, None, headers).status == 200, headers
        assert request(admin_gateway.url, "GET", route, None, headers).status == 404, headers


@pytest.mark.parametrize("route", CLIENT_ROUTES, ids=route_id)
def test_the_admin_listener_serves_no_client_route(gateways, route):
    admin_url = gateways[2].admin_url
    for method in sorted(route.methods):
        for model in models_of(route):
            answer = request(admin_url, method, route, model, RIGHT_KEY)
            assert answer.status == 404, f"{method} {admin_url}{route.path(model)}: {answer}"


@pytest.mark.parametrize("route", [r for r in ROUTES if r.forwarded], ids=route_id)
def test_head_of_a_forwarded_route_answers_as_the_backend_does(sim, gateways, route):
    """Status and Content-Length of the backend's own answer to HEAD: no body, but its length."""
    backend = request(sim.url, "HEAD", route, KNOWN, NO_KEY)
    for gateway in gateways:
        assert request(gateway.url, "HEAD", route, KNOWN, RIGHT_KEY) == backend, gateway.url
