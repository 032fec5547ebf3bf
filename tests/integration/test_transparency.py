"""The gateway is transparent: real clients get the same answers through it as from the backend."""

import asyncio
import json
import time
from urllib.parse import urlsplit

import aiohttp
import numpy as np
import openai
import pytest
import tritonclient.http as triton
from openai import OpenAI

from tests.integration.scripted import OK, Reader, ScriptedServer, Writer
from tests.integration.servers import gateway_config, http_get

pytestmark = pytest.mark.anyio
INFER_JSON = {
    "id": "req-1",
    "inputs": [
        {"name": "INPUT0", "shape": [2, 3], "datatype": "FP32", "data": [1.5, 2, 3, 4, 5, 6]},
        {"name": "INPUT1", "shape": [2], "datatype": "BYTES", "data": ["héllo", "world"]},
    ],
}


@pytest.fixture(scope="module")
def pair(module_launcher):
    sim = module_launcher.sim(slots=4, base_ms=5, token_ms=40)
    return sim, module_launcher.gateway(gateway_config([(sim.url, 4)]))


async def test_json_infer_answer_equals_the_direct_answer(pair):
    sim, gateway = pair
    async with aiohttp.ClientSession() as session:
        direct = await session.post(sim.url + "/v2/models/sim/infer", json=INFER_JSON)
        proxied = await session.post(gateway.url + "/v2/models/sim/infer", json=INFER_JSON)
        assert proxied.status == direct.status == 200
        assert await proxied.read() == await direct.read()
        assert proxied.headers["Content-Type"] == direct.headers["Content-Type"]
        timing = proxied.headers["Server-Timing"]
        assert timing.startswith("queue;dur=") and ", upstream;dur=" in timing


def test_tritonclient_binary_tensors_pass_byte_for_byte(pair):
    _, gateway = pair
    client = triton.InferenceServerClient(gateway.url.removeprefix("http://"))
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready("sim")
    assert client.get_model_metadata("sim")["name"] == "sim"
    floats = np.random.default_rng(7).standard_normal((4, 16)).astype(np.float32)
    words = np.array([b"alpha", b"\x00\xffbinary", b"", b"gamma"], dtype=np.object_)
    inputs = [
        triton.InferInput("INPUT0", list(floats.shape), "FP32"),
        triton.InferInput("INPUT1", [4], "BYTES"),
    ]
    inputs[0].set_data_from_numpy(floats, binary_data=True)
    inputs[1].set_data_from_numpy(words, binary_data=True)
    outputs = [
        triton.InferRequestedOutput("OUTPUT0", binary_data=True),
        triton.InferRequestedOutput("OUTPUT1"),
    ]
    result = client.infer("sim", inputs, outputs=outputs)
    assert np.array_equal(result.as_numpy("OUTPUT0"), floats)
    assert list(result.as_numpy("OUTPUT1")) == list(words)
    client.close()


def test_openai_stream_arrives_chunk_by_chunk(pair):
    _, gateway = pair
    client = OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    started = time.monotonic()
    arrivals, text = [], ""
    stream = client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=8
    )
    for chunk in stream:
        arrivals.append(time.monotonic() - started)
        text += chunk.choices[0].delta.content or ""
    assert text == " ".join(f"tok{i}" for i in range(8))
    # 7 gaps of 40 ms between tokens: buffering would deliver everything at once.
    assert arrivals[-1] - arrivals[0] > 0.2


def test_openai_completion_and_embeddings(pair):
    _, gateway = pair
    client = OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0)
    completion = client.completions.create(model="sim", prompt="hi", max_tokens=3)
    assert completion.choices[0].text == "tok0 tok1 tok2"
    embeddings = client.embeddings.create(model="sim", input=["a", "b"])
    assert len(embeddings.data) == 2
    assert [m.id for m in client.models.list()] == ["sim"]
    assert client.models.retrieve("sim").id == "sim"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")


def test_model_config_and_metadata_pass_through(pair):
    sim, gateway = pair
    for path in ("/v2/models/sim/config", "/v2/models/sim", "/v2/models/sim/versions/1/ready"):
        assert http_get(gateway.url + path) == http_get(sim.url + path)


def test_health_routes_answer_from_the_gateway(pair):
    _, gateway = pair
    assert http_get(gateway.url + "/healthz")[0] == 200
    status, body = http_get(gateway.url + "/readyz")
    assert status == 200 and json.loads(body)["models"] == {"sim": True}
    assert http_get(gateway.url + "/v2/health/ready")[0] == 200


@pytest.mark.parametrize("sent_length", [True, False])
async def test_an_answer_without_a_body_goes_on_without_a_length(start_gateway, sent_length):
    """A 204 (or 304) from the backend reaches the client without Content-Length, which RFC 9110
    forbids on it, and without a body."""

    # Some servers say `content-length: 0` on a 204, which is read whole; others send nothing.
    length = b"content-length: 0\r\n" if sent_length else b""
    no_content_answer = b"HTTP/1.1 204 No Content\r\n" + length + b"\r\n"

    async def no_content(server: ScriptedServer, reader: Reader, writer: Writer) -> None:
        while request := await server.read_request(reader):
            writer.write(no_content_answer if request.startswith(b"POST") else OK)
            await writer.drain()

    async with ScriptedServer(no_content) as server:
        url = f"http://127.0.0.1:{server.origin.port}"
        gateway = await asyncio.to_thread(start_gateway, gateway_config([(url, 1)]))
        reader, writer = await asyncio.open_connection("127.0.0.1", urlsplit(gateway.url).port)
        try:
            writer.write(b"POST /v2/models/sim/infer HTTP/1.1\r\nHost: g\r\nContent-Length: 2\r\n\r\n{}")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            writer.write(b"GET /v2/health/live HTTP/1.1\r\nHost: g\r\n\r\n")  # the connection goes on
            after = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        finally:
            writer.close()
    assert head.startswith(b"HTTP/1.1 204 ")
    fields = head.lower()
    assert b"content-length" not in fields and b"transfer-encoding" not in fields
    assert after.startswith(b"HTTP/1.1 200 ")
