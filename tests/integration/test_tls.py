"""TLS on the client listener (and on the gRPC one): HTTPS and mutual TLS with real clients, the
admin listener left plain for probes and Prometheus, and certificates that cannot serve refused at
config time."""

from __future__ import annotations

import asyncio
import signal
import ssl
import subprocess
import sys

import aiohttp
import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import yaml

from tests.eventually import eventually, eventually_blocking
from tests.integration.servers import gateway_config, http_get
from tests.integration.test_backpressure import clear_the_fault, hang_the_backend, wait_for_hanging

pytestmark = pytest.mark.anyio
INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 2], "datatype": "FP32", "data": [1, 2]}]}


def tls_config(sim, cert, key, **tls_extra):
    config = gateway_config([(sim.url, 2)])
    tls = {"cert_file": str(cert), "key_file": str(key), **tls_extra}
    config["listen"]["tls"] = tls
    config["admin_listen"] = {"host": "127.0.0.1", "port": 0}
    config["grpc_listen"] = {"host": "127.0.0.1", "port": 0, "tls": tls}
    return config


def trusting(cert, client: tuple | None = None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(cert))
    if client is not None:
        context.load_cert_chain(*map(str, client))
    return context


async def test_the_client_listener_serves_https_and_the_admin_listener_stays_plain(
    start_sim, start_gateway, tls_cert
):
    cert, key = tls_cert
    sim = start_sim(slots=2, base_ms=5)
    gateway = start_gateway(tls_config(sim, cert, key))
    assert gateway.url.startswith("https://") and gateway.admin_url.startswith("http://")
    async with aiohttp.ClientSession() as http:
        url = gateway.url + "/v2/models/sim/infer"
        async with http.post(url, json=INFER, ssl=trusting(cert)) as reply:
            assert reply.status == 200 and (await reply.json())["outputs"][0]["data"] == [1, 2]
        plain = url.replace("https://", "http://")
        with pytest.raises(aiohttp.ClientError):  # plain HTTP on the TLS port gets no answer
            async with http.post(plain, json=INFER) as reply:
                await reply.read()
    # Probes and Prometheus read the admin listener as before, in plain HTTP.
    assert http_get(gateway.admin_url + "/readyz")[0] == 200
    assert gateway.metric("gateway_requests_total", outcome="ok") == 1
    # gRPC over TLS, tritonclient trusting the certificate.
    client = triton_grpc.InferenceServerClient(gateway.grpc_target, ssl=True, root_certificates=str(cert))
    try:
        data = np.array([[1.5, 2.5]], dtype=np.float32)
        tensor = triton_grpc.InferInput("INPUT0", [1, 2], "FP32")
        tensor.set_data_from_numpy(data)
        np.testing.assert_array_equal(client.infer("sim", [tensor]).as_numpy("OUTPUT0"), data)
    finally:
        client.close()


async def test_mutual_tls_wants_a_client_certificate_signed_by_the_client_ca(
    start_sim, start_gateway, tls_cert
):
    cert, key = tls_cert  # self-signed: it is its own CA, and the client's certificate too
    sim = start_sim(slots=2, base_ms=5)
    gateway = start_gateway(tls_config(sim, cert, key, client_ca_file=str(cert)))
    url = gateway.url + "/v2/models/sim/infer"
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=INFER, ssl=trusting(cert, client=(cert, key))) as reply:
            assert reply.status == 200
        with pytest.raises(aiohttp.ClientError):
            async with http.post(url, json=INFER, ssl=trusting(cert)) as reply:
                await reply.read()
    async with grpc.aio.secure_channel(
        gateway.grpc_target, grpc.ssl_channel_credentials(cert.read_bytes())
    ) as bare:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await bare.unary_unary("/inference.GRPCInferenceService/ServerLive")(b"", timeout=5)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    assert gateway.metric("gateway_requests_total", outcome="ok") == 1


@pytest.mark.parametrize("broken", ["missing", "not pem", "wrong key"])
def test_a_certificate_that_cannot_serve_makes_the_config_invalid(tmp_path, tls_cert, broken):
    cert, key = tls_cert
    other_key = tmp_path / "other.pem"
    subprocess.run(["openssl", "genrsa", "-out", str(other_key), "2048"], check=True, capture_output=True)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    cert_file, key_file = {
        "missing": (tmp_path / "nowhere.pem", key),
        "not pem": (junk, key),
        "wrong key": (cert, other_key),
    }[broken]
    config = gateway_config([("http://127.0.0.1:9", 1)])
    config["listen"]["tls"] = {"cert_file": str(cert_file), "key_file": str(key_file)}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "gateway", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2, done.stderr
    assert "listen.tls" in done.stderr and f"cannot load {cert_file}" in done.stderr, done.stderr


async def test_sigterm_drains_a_tls_gateway_and_its_plain_admin_listener_answers_throughout(
    start_sim, start_gateway, tls_cert
):
    cert, key = tls_cert
    sim = start_sim(slots=1, base_ms=5)
    gateway = start_gateway(tls_config(sim, cert, key))
    await hang_the_backend(sim)
    async with aiohttp.ClientSession() as http:
        url = gateway.url + "/v2/models/sim/infer"
        held = asyncio.ensure_future(http.post(url, json=INFER, ssl=trusting(cert)))
        await wait_for_hanging(sim, 1)
        gateway.signal(signal.SIGTERM)
        await eventually(
            lambda: http_get(gateway.admin_url + "/readyz")[0] == 503, what="/readyz 503 while draining"
        )
        await clear_the_fault(sim)
        async with await held as reply:
            assert reply.status == 200
    assert await asyncio.to_thread(gateway.wait, 15) == 0


def test_a_decoupled_models_requests_go_up_over_tls_to_the_backends_grpc_port(
    start_sim, start_gateway, tls_cert
):
    """A gateway whose backend (here another gateway, any KServe v2 gRPC server does) serves https:
    its decoupled model's calls go to the backend's gRPC port over TLS, trusting the backend's CA."""
    cert, key = tls_cert
    sim = start_sim(slots=2, base_ms=5)
    backend = start_gateway(tls_config(sim, cert, key))
    eventually_blocking(lambda: "grpc listening on" in backend.log(), what="the backend's gRPC listener")
    grpc_port = int(backend.grpc_target.rsplit(":", 1)[1])
    config = gateway_config([(backend.url, 2)])
    config["models"][0]["decoupled"] = True
    config["models"][0]["backends"][0].update(grpc_port=grpc_port, tls={"ca_file": str(cert)})
    config["grpc_listen"] = {"host": "127.0.0.1", "port": 0}
    gateway = start_gateway(config)
    client = triton_grpc.InferenceServerClient(gateway.grpc_target)
    answers: list = []
    try:
        client.start_stream(
            callback=lambda result, error: answers.append((result, error)),
            headers={"x-request-id": "up-over-tls"},
        )
        data = np.array([[1.5, 2.5]], dtype=np.float32)
        tensor = triton_grpc.InferInput("INPUT0", [1, 2], "FP32")
        tensor.set_data_from_numpy(data)
        client.async_stream_infer("sim", [tensor], request_id="over-tls")
        client.stop_stream()  # waits for the stream's answers
    finally:
        client.close()
    assert len(answers) == 1 and answers[0][1] is None, answers
    np.testing.assert_array_equal(answers[0][0].as_numpy("OUTPUT0"), data)
    assert backend.metric("gateway_requests_total", model="sim", outcome="ok") == 1
    assert "up-over-tls" in backend.log()  # the backend's access line names the client's request id


def test_a_backend_whose_ca_file_cannot_be_read_is_not_ready_and_the_log_says_why(
    start_sim, start_gateway, tls_cert, tmp_path
):
    cert, key = tls_cert
    sim = start_sim(slots=2, base_ms=5)
    backend = start_gateway(tls_config(sim, cert, key))
    missing = tmp_path / "gone.pem"
    config = gateway_config([(backend.url, 2)])
    config["models"][0]["backends"][0]["tls"] = {"ca_file": str(missing)}
    gateway = start_gateway(config, wait_ready=False)
    eventually_blocking(
        lambda: "its tls settings cannot be used" in gateway.log() and str(missing) in gateway.log(),
        what="the gateway to say why the backend is not ready",
    )
    assert gateway.metric("gateway_backend_ready", model="sim") == 0
