"""A hypothesis fuzz of every route: methods, paths, headers and bodies a client can send.

One real simulator for the module, and a real gateway without tenants and one with; each example
sends a few requests at once over raw sockets (so that some wait in the queue of a backend with one
slot), now and then several one after the other on a keep-alive connection, and reads every answer
whole with h11. What the gateway routes where is read from its app, built in process from the same
config. The properties, for every request:

- it gets a complete HTTP answer: no reset, no cut body, no hang;
- a 431 if and only if its head is over the header limits;
- the gateway answers no 5xx of its own: a 5xx is the backend's, passed through (a relayed answer
  carries Server-Timing), or a 504 `upstream_timeout` for a request that set its own budget;
- the gateway's own errors are JSON with an `error`, and a `reason` (KServe) or `code` (OpenAI)
  that is an outcome, on every admitted route;
- it is counted once in `gateway_requests_total`, as the outcome its answer shows: every
  request to an inference route, and a model route's refusal before it forwards (see `expected`);
- afterwards the queue is empty and no slot is held, in the gateway and in the simulator;

and after the run, the gateway logged no traceback.
"""

from __future__ import annotations

import asyncio
import copy
import json
import struct
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import h11
import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from starlette.routing import Match, Route

from gateway.errors import ROUTE_REASONS
from gateway.flow.request_meta import Problem, RequestClassifier
from gateway.http.hot_routes import INFER_ROUTES, OPENAI_PATHS, v2_infer_params
from gateway.http.kserve import ModelPassthrough
from gateway.programs.app import create_app
from gateway.server.client_limits import Cut
from gateway.settings import parse_settings
from policies.outcomes import Outcome
from tests.eventually import eventually_blocking
from tests.integration.servers import gateway_config

MAX_BODY_BYTES = 64 * 1024
MAX_HEADER_BYTES = 8 * 1024
MAX_HEADERS = 32
KEY = "gold-key-0123456789"
OUTCOMES = frozenset(outcome.value for outcome in Outcome)
READ_TIMEOUT_S = 15.0


def config(backend_url: str, *, tenants: bool) -> dict[str, Any]:
    return gateway_config(
        [(backend_url, 1)],
        expected_service_ms=5,
        limits={
            "max_body_bytes": MAX_BODY_BYTES,
            "max_header_bytes": MAX_HEADER_BYTES,
            "max_headers": MAX_HEADERS,
        },
        tenants=[{"name": "gold", "api_keys": [KEY]}] if tenants else [],
    )


# -- what the gateway routes where, read from the app as the gateway process builds it ---------------


@dataclass(frozen=True, slots=True)
class Routing:
    """The gateway's routes and request classifier, built in process from the same config."""

    routes: list[Route]
    classifier: RequestClassifier
    models: frozenset[str]

    @classmethod
    def of(cls, data: dict[str, Any]) -> Routing:
        settings = parse_settings(data)
        app = create_app(settings)
        client = getattr(app, "client", app)  # with admin_listen, the client's app is served apart
        routes = [route for route in client.routes if isinstance(route, Route)]
        return cls(routes, RequestClassifier(settings), frozenset(m.name for m in settings.models))

    def expected(self, sent: Sent, answer: Answer) -> str | None:
        """The outcome `sent` is counted as, or None when it is not counted.

        Inference routes count every request; a model route counts the refusals it makes before it
        forwards anything (no key, a bad header, an unknown model); nothing else is counted.
        """
        if sent.oversized:
            return None
        if sent.inference:
            return None if sent.method != "POST" else answer.outcome()
        for route in self.routes:
            match, child = route.matches({"type": "http", "path": sent.path, "method": sent.method})
            if match is Match.FULL:
                if not isinstance(route.endpoint, ModelPassthrough):
                    return None
                problem = self.classifier.classify(sent.asgi_headers())
                if isinstance(problem, Problem):
                    return problem.outcome.value
                known = child["path_params"]["model"] in self.models
                return None if known else Outcome.UNKNOWN_MODEL.value
        return None


# -- requests ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sent:
    method: str
    target: str
    headers: list[tuple[bytes, bytes]]
    """The headers the test chose, in order; Host, Connection and the framing are added."""
    body: bytes | None
    framing: str
    """"length", "chunked", or "over_limit" (a Content-Length over the limit, nothing sent)."""
    chunk_sizes: tuple[int, ...] = ()

    @property
    def path(self) -> str:
        """The path as the gateway routes it: percent-decoded, as uvicorn decodes it."""
        return unquote(self.target.split("?", 1)[0])

    @property
    def inference(self) -> bool:
        """Sent to a route `InferenceRoutes` serves (POST only: another method is a 405)."""
        return self.path in OPENAI_PATHS or v2_infer_params(self.path) is not None

    @property
    def oversized(self) -> bool:
        """Its head is over the gateway's limits: refused 431 before any route sees it."""
        head = self.wire(close=True).split(b"\r\n\r\n", 1)[0]
        return len(head) + 4 > MAX_HEADER_BYTES or head.count(b"\r\n") > MAX_HEADERS

    def asgi_headers(self) -> list[tuple[bytes, bytes]]:
        return [(name.lower(), value) for name, value in self.headers]

    def header(self, name: bytes) -> bytes | None:
        values = [v for k, v in self.asgi_headers() if k == name]
        return values[-1] if values else None

    def wire(self, *, close: bool) -> bytes:
        connection = b"close" if close or self.framing == "over_limit" else b"keep-alive"
        lines = [f"{self.method} {self.target} HTTP/1.1".encode(), b"Host: 127.0.0.1"]
        lines.append(b"Connection: " + connection)
        payload = b""
        if self.framing == "over_limit":
            lines.append(b"Content-Length: %d" % (MAX_BODY_BYTES + 1))
        elif self.body is not None and self.framing == "chunked":
            lines.append(b"Transfer-Encoding: chunked")
            payload = _chunked(self.body, self.chunk_sizes)
        elif self.body is not None:
            lines.append(b"Content-Length: %d" % len(self.body))
            payload = self.body
        lines += [name + b": " + value for name, value in self.headers]
        return b"\r\n".join(lines) + b"\r\n\r\n" + payload


def _chunked(body: bytes, sizes: tuple[int, ...]) -> bytes:
    out, offset = [], 0
    for size in (*sizes, len(body)):
        piece = body[offset : offset + size]
        if piece:
            out.append(b"%x\r\n%s\r\n" % (len(piece), piece))
        offset += len(piece)
    return b"".join(out) + b"0\r\n\r\n"


@dataclass(slots=True)
class Answer:
    status: int = 0
    headers: dict[bytes, bytes] = field(default_factory=dict)
    body: bytes = b""

    @property
    def relayed(self) -> bool:
        """A backend's answer passed through an admitted route (the gateway adds Server-Timing)."""
        return b"server-timing" in self.headers

    def json(self) -> Any:
        return json.loads(self.body)

    def reason(self) -> str | None:
        """The outcome a gateway error names: KServe `reason`, OpenAI `error.code`."""
        try:
            payload = self.json()
        except ValueError:
            return None
        if not isinstance(payload, dict):
            return None
        error = payload.get("error")
        reason = error.get("code") if isinstance(error, dict) else payload.get("reason")
        return reason if isinstance(reason, str) else None

    def outcome(self) -> str | None:
        """The outcome this answer was counted as, if it was: the backend's, or the gateway's own."""
        if not self.relayed:
            return self.reason()
        if self.status >= 500:
            return Outcome.BACKEND_SERVER_ERROR.value
        return Outcome.BACKEND_CLIENT_ERROR.value if self.status >= 400 else Outcome.OK.value


async def converse(port: int, requests: list[Sent]) -> list[Answer]:
    """Send `requests` one after the other on a keep-alive connection (a new one whenever the
    gateway closes it) and read each answer whole; h11 checks every answer's framing."""
    answers: list[Answer] = []
    connection: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    unread = b""
    try:
        for index, sent in enumerate(requests):
            if connection is None:
                connection, unread = await asyncio.open_connection("127.0.0.1", port), b""
            reader, writer = connection
            close = index == len(requests) - 1
            writer.write(sent.wire(close=close))
            await writer.drain()
            async with asyncio.timeout(READ_TIMEOUT_S):
                answer, unread, still_open = await _read_answer(reader, sent, unread)
            answers.append(answer)
            if close or not still_open or sent.framing == "over_limit":
                writer.close()
                await writer.wait_closed()
                connection = None
    finally:
        if connection is not None:
            connection[1].close()
            await connection[1].wait_closed()
    return answers


async def _read_answer(reader: asyncio.StreamReader, sent: Sent, unread: bytes) -> tuple[Answer, bytes, bool]:
    """The answer to `sent`, the bytes after it, and whether the connection stays open."""
    parser = h11.Connection(h11.CLIENT)
    parser.send(h11.Request(method=sent.method, target="/", headers=[("Host", "127.0.0.1")]))
    parser.send(h11.EndOfMessage())
    if unread:  # (an empty receive_data is h11 for "closed")
        parser.receive_data(unread)
    answer, chunks = Answer(), []
    while True:
        event = parser.next_event()
        if event is h11.NEED_DATA:
            parser.receive_data(await reader.read(65536))
        elif isinstance(event, h11.InformationalResponse):
            continue  # 100 Continue, for Expect: 100-continue
        elif isinstance(event, h11.Response):
            answer.status = event.status_code
            answer.headers = {k.lower(): v for k, v in event.headers}
        elif isinstance(event, h11.Data):
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            break
    answer.body = b"".join(chunks)
    data, closed = parser.trailing_data
    return answer, data, not closed and parser.their_state is h11.DONE


# -- strategies ---------------------------------------------------------------------------------------
# Each choice is mostly the valid one, so that most requests reach the backend and its answers come
# back through the gateway, and sometimes anything a client can send. Hypothesis shrinks a draw
# toward its first alternative: a failing example shrinks toward a valid request.


def mostly(
    usual: st.SearchStrategy[Any], *rare: st.SearchStrategy[Any], in_ten: int = 9
) -> st.SearchStrategy[Any]:
    """`usual` `in_ten` times in ten, else one of `rare`."""
    return st.integers(0, 9).flatmap(lambda roll: usual if roll < in_ten else st.one_of(*rare))


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """None (the header is not sent) half the time."""
    return st.one_of(st.none(), strategy)


_UNRESERVED = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~"
_PATH_CHARS = _UNRESERVED + "!$&'()*+,;=:@"
_TOKEN = _UNRESERVED.replace(".", "") + "!#$%&'*+^`|"
_FRAMING = {b"host", b"connection", b"content-length", b"transfer-encoding"}
_ODD_SEGMENTS = [
    "SIM",
    "no-such",
    "",
    ".",
    "..",
    "sim%2Finfer",
    "%2e%2e",
    "%00",
    "%ff",
    "%E2%82%AC",
    "%",
    "%zz",
]

escapes = st.lists(st.integers(0, 255), min_size=1, max_size=3).map(
    lambda octets: "".join(f"%{o:02X}" for o in octets)
)
models = mostly(
    st.sampled_from(["sim", "sim", "sim", "%73im", "%73%69%6D"]),
    st.sampled_from(_ODD_SEGMENTS),
    st.text(alphabet=_PATH_CHARS, min_size=1, max_size=12),
    escapes,
    in_ten=7,
)
versions = mostly(st.sampled_from(["1", "2"]), st.sampled_from(_ODD_SEGMENTS), escapes)
INFERENCE_TEMPLATES = [*INFER_ROUTES, *sorted(OPENAI_PATHS)]
OTHER_TEMPLATES = [
    "/v2/models/{model}",
    "/v2/models/{model}/ready",
    "/v2/models/{model}/config",
    "/v2/models/{model}/versions/{version}",
    "/v2/models/{model}/versions/{version}/config",
    "/v2/models/{model}/{version}",
    "/v1/models",
    "/v1/models/{model}",
    "/v2",
    "/v2/health/ready",
    "/healthz",
    "/readyz",
    "/metrics",
    "/{model}",
]


@st.composite
def targets(draw: st.DrawFn, template: str) -> str:
    path = template.replace("{model}", draw(models)).replace("{version}", draw(versions))
    path += draw(mostly(st.just(""), st.sampled_from(["/", "/x", "//"])))
    query = draw(mostly(st.just(""), st.text(alphabet=_PATH_CHARS + "/?", max_size=16)))
    return path + ("?" + query if query else "")


def _latin1(text: str) -> bytes:
    return text.encode("latin-1")


# Field values as a client can send them: visible latin-1, no surrounding whitespace.
values = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0xFF, exclude_characters="\x7f"),
    max_size=40,
).map(_latin1)
numbers = st.integers(-(10**12), 10**12).map(lambda n: str(n).encode())
priorities = mostly(
    st.sampled_from([b"high", b"low"]), st.sampled_from([b"HIGH", b"urgent", b"", b"h" * 65]), values
)
tenant_names = mostly(st.sampled_from([b"acme", b"t" * 128]), st.sampled_from([b"t" * 129, b""]), values)
budgets = mostly(
    st.sampled_from([b"5000", b"30000"]),
    st.sampled_from([b"1", b"20", b"60", b"0", b"-1", b"1e3", b"0x10", b"", b"86400001", b"9" * 12]),
    st.sampled_from([b"\xd9\xa3", b"86400000"]),
    numbers,
)
authorizations = mostly(
    st.just(f"Bearer {KEY}".encode()),
    st.sampled_from([f"bearer  {KEY}".encode(), f"Basic {KEY}".encode(), b"Bearer", b"Bearer "]),
    st.sampled_from([b"Bearer wrong-key-0123456789", b"B" * 1100]),
    values,
)
content_types = st.sampled_from(
    [b"application/json", b"application/octet-stream", b"text/plain", b"", b"x/y; q=\xff"]
)
odd_header_lengths = st.one_of(
    st.sampled_from([b"0", b"-1", b"x", b"99999999999999999999"]), st.integers(0, 300).map(str).map(_latin1)
)
field_names = (
    st.text(alphabet=_TOKEN, min_size=1, max_size=16)
    .map(_latin1)
    .filter(lambda name: name.lower() not in _FRAMING)
)


A_LARGE_FIELD = [(b"X-Large", b"v" * MAX_HEADER_BYTES)]
MANY_FIELDS = [(b"X-Field-%d" % i, b"1") for i in range(MAX_HEADERS)]


@st.composite
def header_lists(draw: st.DrawFn) -> list[tuple[bytes, bytes]]:
    chosen = {
        b"X-Priority": draw(maybe(priorities)),
        b"X-Tenant": draw(maybe(tenant_names)),
        b"X-Request-Timeout-Ms": draw(maybe(budgets)),
        b"Authorization": draw(mostly(authorizations, st.none())),
        b"Content-Type": draw(maybe(content_types)),
        b"Expect": draw(mostly(st.none(), st.just(b"100-continue"))),
        b"X-Forwarded-For": draw(mostly(st.none(), st.sampled_from([b"10.0.0.1", b"", b"1.1.1.1, 2.2.2.2"]))),
        b"Inference-Header-Content-Length": draw(mostly(st.none(), odd_header_lengths)),
    }
    headers = [(name, value) for name, value in chosen.items() if value is not None]
    extra = mostly(st.just([]), st.lists(st.tuples(field_names, values), max_size=5), in_ten=8)
    return headers + draw(mostly(extra, st.just(A_LARGE_FIELD), st.just(MANY_FIELDS)))


json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(),
        st.text(max_size=12),
        st.sampled_from([10**40, -(2**63), 1e308, "sim", "FP32", "BYTES", "INPUT0", "OUTPUT0"]),
    ),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)

INFER_JSON = {
    "id": "fuzz",
    "inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1.5, 2]}],
    "outputs": [{"name": "OUTPUT0"}],
}


def _places(value: Any) -> Iterator[tuple[Any, Any]]:
    """Every (container, key) place inside a JSON value, for mutating one of them."""
    if isinstance(value, dict):
        for key, inner in value.items():
            yield value, key
            yield from _places(inner)
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            yield value, index
            yield from _places(inner)


@st.composite
def mutated(draw: st.DrawFn, base: Any) -> Any:
    """`base` as it is, or with a few places replaced, deleted or wrapped, or itself replaced."""
    value = copy.deepcopy(base)
    for _ in range(draw(mostly(st.just(0), st.integers(1, 3)))):
        places = list(_places(value))
        if not places or draw(st.integers(0, 9)) == 0:
            return draw(json_values)
        container, key = draw(st.sampled_from(places))
        action = draw(st.sampled_from(["replace", "replace", "delete", "wrap"]))
        if action == "replace":
            container[key] = draw(json_values)
        elif action == "wrap":
            container[key] = [container[key]]
        elif isinstance(container, dict):
            del container[key]
        else:
            container.pop(key)
    return value


def _dumps(value: Any) -> bytes:
    return json.dumps(value).encode()


def binary_header(count: int, datatype: str, declared_size: int, binary_output: bool) -> dict[str, Any]:
    """The JSON header of a binary-extension infer request with one input of `count` FP32s."""
    parameters = {"binary_data_size": declared_size}
    return {
        "inputs": [{"name": "INPUT0", "shape": [1, count], "datatype": datatype, "parameters": parameters}],
        "outputs": [{"name": "OUTPUT0", "parameters": {"binary_data": binary_output}}],
    }


def _floats(count: int) -> bytes:
    return struct.pack(f"<{count}f", *range(count))


@st.composite
def binary_tensors(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A binary-extension infer body and its Inference-Header-Content-Length (maybe off)."""
    raw = _floats(draw(st.integers(0, 8)))
    datatype = draw(mostly(st.just("FP32"), st.sampled_from(["INT8", "BYTES", "NOPE"])))
    size = draw(mostly(st.just(len(raw)), st.sampled_from([0, 99])))
    header = binary_header(len(raw) // 4, datatype, size, draw(st.booleans()))
    head = _dumps(draw(mutated(header)))
    declared = len(head) + draw(mostly(st.just(0), st.sampled_from([-1, 1, 10**6])))
    return head + raw, str(declared).encode()


@st.composite
def openai_bodies(draw: st.DrawFn) -> Any:
    body: dict[str, Any] = {
        "model": draw(mostly(st.just("sim"), st.sampled_from(["no-such", "", "SIM"]), json_values)),
        "messages": [{"role": "user", "content": "hi"}],
        "prompt": "hi",
        "input": draw(st.sampled_from(["hi", ["a", "b"]])),
        "max_tokens": draw(mostly(st.integers(1, 4), st.sampled_from([0, -1, 10**30, 1e308, "2"]))),
    }
    stream = draw(mostly(st.booleans(), st.sampled_from(["yes", 1, None])))
    if stream is not None:
        body["stream"] = stream
    return draw(mutated(body))


def _nested(depth: int) -> bytes:
    return b'{"model": "sim", "x": ' + b"[" * depth + b"]" * depth + b"}"


@st.composite
def bodies(draw: st.DrawFn, target: str) -> tuple[bytes, bytes | None]:
    """A body (mostly of the kind the target's route takes) and, for a binary tensor body, the
    Inference-Header-Content-Length it wants."""
    fitting = "openai" if target.startswith("/v1/") else "kserve"
    kind = draw(
        mostly(
            st.sampled_from([fitting, fitting, "binary" if fitting == "kserve" else fitting]),
            st.sampled_from(["kserve", "openai", "binary", "junk", "deep", "number", "empty", "big"]),
            in_ten=7,
        )
    )
    if kind == "kserve":
        return _dumps(draw(mutated(INFER_JSON))), None
    if kind == "openai":
        return _dumps(draw(openai_bodies())), None
    if kind == "binary":
        return draw(binary_tensors())
    if kind == "junk":
        return draw(st.binary(max_size=300)), None
    if kind == "deep":
        return _nested(draw(st.sampled_from([50, 2000, 20_000]))), None
    if kind == "number":
        number = draw(st.sampled_from([b"9" * 5000, b"1e999999", b"-0.0e-99999", b"1" + b"0" * 400]))
        return b'{"model": "sim", "max_tokens": ' + number + b', "prompt": "x"}', None
    if kind == "big":  # over the limit, and sent
        return b'{"model": "sim", "pad": "' + b"x" * MAX_BODY_BYTES + b'"}', None
    return b"", None


METHODS = ["POST", "GET", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH"]


@st.composite
def requests(draw: st.DrawFn) -> Sent:
    """Mostly an inference request (POST), else mostly a GET of another route."""
    inference = draw(st.integers(0, 9)) < 7
    template = draw(st.sampled_from(INFERENCE_TEMPLATES if inference else OTHER_TEMPLATES))
    target = draw(targets(template))
    method = draw(mostly(st.just("POST" if inference else "GET"), st.sampled_from(METHODS)))
    headers = draw(header_lists())
    body: bytes | None = None
    framing = "length"
    sizes: tuple[int, ...] = ()
    if method in ("POST", "PUT", "PATCH") or draw(mostly(st.just(False), st.just(True))):
        body, wanted = draw(bodies(target))
        if wanted is not None and draw(mostly(st.just(True), st.just(False))):
            headers.append((b"Inference-Header-Content-Length", wanted))
        framing = draw(mostly(st.just("length"), st.just("chunked"), st.just("over_limit")))
        if framing == "chunked":
            sizes = tuple(draw(st.lists(st.integers(1, 4096), max_size=4)))
    return Sent(method, target, headers, None if framing == "over_limit" else body, framing, sizes)


def _hostile() -> list[Sent]:
    """One of each kind of request known to have hurt a gateway, sent together in every run."""
    keyed = [(b"Authorization", f"Bearer {KEY}".encode())]
    chat = b'{"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2'
    infer = _dumps(INFER_JSON)
    head = _dumps(binary_header(3, "FP32", 12, binary_output=True))
    binary = [*keyed, (b"Inference-Header-Content-Length", str(len(head)).encode())]
    big_number = b'{"model": "sim", "max_tokens": ' + b"9" * 5000 + b"}"
    return [
        Sent("POST", "/v1/chat/completions", keyed, _nested(20_000), "length"),
        Sent("POST", "/v1/completions", keyed, big_number, "length"),
        Sent("POST", "/v1/chat/completions", keyed, chat + b', "stream": true}', "chunked", (7, 1)),
        Sent("POST", "/v2/models/sim/infer", binary, head + _floats(3), "length"),
        Sent("POST", "/v2/models/%73im/versions/1/infer", keyed, infer, "chunked", (1, 2, 3)),
        Sent("POST", "/v2/models/sim/infer", keyed, None, "over_limit"),
        Sent("POST", "/v2/models/sim/infer", [*keyed, (b"X-Request-Timeout-Ms", b"1")], infer, "length"),
        Sent("POST", "/v2/models/no-such/infer", keyed, infer, "length"),
        Sent("GET", "/v2/models/no-such", keyed, None, "length"),
        Sent("HEAD", "/v2/models/no-such/ready", [], None, "length"),
        Sent("GET", "/v2/models/sim/config", [*keyed, (b"X-Priority", b"urgent")], None, "length"),
        Sent("GET", "/v2/models/sim/infer", keyed, None, "length"),
    ]


KNOWN_HOSTILE = _hostile()
conversations = mostly(
    requests().map(lambda sent: [sent]), st.lists(requests(), min_size=2, max_size=3), in_ten=6
)
"""The requests of one connection: mostly one, sometimes several one after the other (keep-alive)."""


# -- the gateway's counts and gauges ----------------------------------------------------------------


def counted(gateway: Any) -> Counter[str]:
    """gateway_requests_total summed by outcome (the family must exist)."""
    families = {f.name: f for f in text_string_to_metric_families(gateway.metrics())}
    assert "gateway_requests" in families, "gateway_requests_total is not exported"
    totals: Counter[str] = Counter()
    for sample in families["gateway_requests"].samples:
        if sample.name == "gateway_requests_total":
            totals[sample.labels["outcome"]] += int(sample.value)
    return totals


def settled(gateway: Any, sim: Any) -> None:
    """Nothing queued, no slot held: in the gateway's gauges and in the simulator."""
    depth = gateway.metric_by("gateway_queue_depth", "priority", model="sim")
    assert set(depth.values()) == {0.0}, f"queue depth {depth}"
    gateway.assert_metric("gateway_inflight_requests", 0, model="sim")
    assert sim.stats()["inflight"] == 0, f"the simulator still has {sim.stats()['inflight']} in flight"


# -- the properties -------------------------------------------------------------------------------


def check_answer(sent: Sent, answer: Answer) -> None:
    where = f"{sent.method} {sent.target} -> {answer.status} {answer.body[:300]!r}"
    assert 100 <= answer.status <= 599, where
    assert (answer.status == 431) == sent.oversized, f"431 if and only if the head is too large: {where}"
    if answer.status == 431:
        if sent.method != "HEAD":
            assert answer.reason() in {Cut.HEADERS_TOO_LARGE, Cut.TOO_MANY_HEADERS}, where
        return
    own = not answer.relayed
    if own and answer.status >= 500:
        budget = sent.header(b"x-request-timeout-ms")
        timed_out = answer.reason() == "upstream_timeout" and answer.status == 504
        assert timed_out and budget is not None, f"the gateway's own 5xx: {where}"
    if own and answer.status >= 400 and sent.method != "HEAD":
        assert answer.headers.get(b"content-type", b"").startswith(b"application/json"), where
        payload = answer.json()
        assert isinstance(payload, dict) and payload.get("error"), where
        reason = answer.reason()
        assert reason is None or reason in OUTCOMES | ROUTE_REASONS, where
        if sent.method == "POST" and sent.inference:
            assert reason in OUTCOMES, f"an inference route's error names no outcome: {where}"


async def send_all(port: int, connections: list[list[Sent]]) -> list[list[Answer]]:
    return await asyncio.gather(*(converse(port, requests) for requests in connections))


@dataclass
class Target:
    gateway: Any
    sim: Any
    routing: Routing
    port: int
    sent: int = 0


def _target(launcher: Any, sim: Any, *, tenants: bool) -> Target:
    data = config(sim.url, tenants=tenants)
    gateway = launcher.gateway(data)
    return Target(gateway, sim, Routing.of(data), int(gateway.url.rsplit(":", 1)[1]))


@pytest.fixture(scope="module")
def sim(module_launcher):
    return module_launcher.sim(slots=4, base_ms=2)


@pytest.fixture(scope="module")
def open_target(module_launcher, sim):
    return _target(module_launcher, sim, tenants=False)


@pytest.fixture(scope="module")
def keyed_target(module_launcher, sim):
    return _target(module_launcher, sim, tenants=True)


# No shrinking: a failing try waits out `eventually`, and a minute would not shrink far; the
# falsifying batch is printed as it was drawn.
FUZZ = settings(
    max_examples=80,
    deadline=None,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def fuzz_once(target: Target, connections: list[list[Sent]]) -> None:
    gateway, sim = target.gateway, target.sim
    before = counted(gateway)
    answers = asyncio.run(send_all(target.port, connections))
    expected: Counter[str] = Counter()
    batch = [sent for requests in connections for sent in requests]
    for sent, answer in zip(batch, [a for got in answers for a in got], strict=True):
        outcome = target.routing.expected(sent, answer)
        check_answer(sent, answer)
        if outcome is not None:
            expected[outcome] += 1
    target.sent += len(batch)

    def counted_once() -> None:
        grown = counted(gateway) - before
        assert grown == expected, f"counted {dict(grown)}, expected {dict(expected)} for {batch}"

    eventually_blocking(counted_once, timeout_s=5, what="each request counted once")
    eventually_blocking(lambda: settled(gateway, sim), timeout_s=10, what="queue and slots empty")


@pytest.mark.parametrize("tenants", [False, True], ids=["without-tenants", "with-tenants"])
def test_fuzzed_requests_get_a_clean_answer_are_counted_once_and_leave_nothing_held(request, tenants):
    target = request.getfixturevalue("keyed_target" if tenants else "open_target")

    @FUZZ
    @example(connections=[[sent] for sent in KNOWN_HOSTILE])
    @example(connections=[KNOWN_HOSTILE])
    @given(connections=st.lists(conversations, min_size=1, max_size=4))
    def fuzz(connections: list[list[Sent]]) -> None:
        fuzz_once(target, connections)

    fuzz()
    assert target.sent > 0
    log = target.gateway.log()
    assert "Traceback" not in log, log[log.index("Traceback") - 2000 :][:6000]
