"""`inference-gateway serve | probe | sim | demo | plan | simulate | loadtest`: the command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import uvicorn

from gateway.server.serving import CannotListen, bind, run, url_of
from gateway.tools.loadtest import command as loadtest
from gateway.tools.model_server.continuous import SCHEDULING_POLICIES, ContinuousSpec
from gateway.tools.model_server.engine import SERVICE_DISTRIBUTIONS
from gateway.tools.planning import command as plan
from gateway.tools.simulate.command import add_parser as add_simulate
from gateway.version import package_version

if TYPE_CHECKING:  # the settings (pydantic) load only for the commands that read them: `sim` starts without
    from gateway.settings import Settings, Tls

log = logging.getLogger("gateway")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(level=args.log_level.upper(), format=log_format)
    try:
        return int(args.command(args))
    except CannotListen as error:
        print(f"inference-gateway: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


LOG_LEVELS = ["debug", "info", "warning", "error"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="inference-gateway", description=__doc__)
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    serve = commands.add_parser("serve", help="run the gateway from a YAML config")
    serve.add_argument("--config", required=True, help="path to the YAML config")
    serve.add_argument("--host", help="override listen.host")
    serve.add_argument("--port", type=int, help="override listen.port (0 picks a free port)")
    serve.set_defaults(command=_serve)

    check = commands.add_parser(
        "probe", help="ask a running gateway's /healthz (or /readyz) on the listener its config names"
    )
    check.add_argument("--config", required=True, help="the YAML config the gateway runs with")
    check.add_argument("--ready", action="store_true", help="ask /readyz instead of /healthz")
    check.add_argument("--port", type=int, help="the port to ask, where the config says 0")
    check.add_argument("--timeout-ms", type=float, default=2000.0)
    check.set_defaults(command=_probe)

    sim = commands.add_parser("sim", help="run the simulated GPU model server")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=8000)
    sim.add_argument("--metrics-port", type=int, default=8002, help="-1 serves metrics on --port only")
    sim.add_argument("--slots", type=int, default=8, help="execution slots; the FIFO behind is unbounded")
    sim.add_argument("--base-ms", type=float, default=40.0, help="service time of a batch of one")
    sim.add_argument("--per-item-ms", type=float, default=0.0, help="added per item of a batch")
    sim.add_argument("--token-ms", type=float, default=0.0, help="delay per generated token (OpenAI routes)")
    sim.add_argument("--tokens", type=int, default=16, help="tokens generated when max_tokens is not sent")
    sim.add_argument(
        "--on-disconnect",
        choices=["finish", "stop"],
        default="finish",
        help="a request whose client leaves: computed to the end (Triton, KServe) or stopped at once (vLLM)",
    )
    sim.add_argument(
        "--service-dist",
        choices=SERVICE_DISTRIBUTIONS,
        default="fixed",
        help="the base part of each service time: base-ms always, or drawn with mean base-ms, exponential "
        "or long-tail (90%% a quarter of it, 10%% 7.75 times it)",
    )
    sim.add_argument("--seed", type=int, help="seed of the service-time draws (default: unseeded)")
    _continuous_arguments(sim)
    sim.set_defaults(command=_sim)

    demo = commands.add_parser("demo", help="run the simulator and the gateway in front of it")
    demo.add_argument("--port", type=int, default=8080)
    demo.set_defaults(command=_demo)

    plan.register(commands)
    add_simulate(commands)
    loadtest.register(commands)
    for command in commands.choices.values():  # `serve --log-level debug` as well as before it
        command.add_argument("--log-level", choices=LOG_LEVELS, default=argparse.SUPPRESS)
    return parser


def _continuous_arguments(sim: argparse.ArgumentParser) -> None:
    engine = sim.add_argument_group("continuous batching (--engine continuous: OpenAI routes, as vLLM)")
    engine.add_argument(
        "--engine",
        choices=["slots", "continuous"],
        default="slots",
        help="slots: --slots requests at a time, the rest wait; continuous: sequences step together",
    )
    engine.add_argument("--max-num-seqs", type=int, default=64, help="sequences running together")
    engine.add_argument("--step-ms", type=float, default=20.0, help="a decode step with one running")
    engine.add_argument(
        "--step-growth", type=float, default=1.0, help="added to the step at max-num-seqs, x step-ms"
    )
    engine.add_argument(
        "--context-ms-per-1k", type=float, default=0.0, help="added per step per 1000 tokens held"
    )
    engine.add_argument(
        "--prefill-ms-per-1k", type=float, default=10.0, help="prefill time per 1000 prompt tokens"
    )
    engine.add_argument("--kv-tokens", type=int, default=1 << 20, help="the KV cache, in tokens")
    engine.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs")
    engine.add_argument("--served-model-name", default="sim", help="model_name of the vLLM metrics")


def _continuous_spec(args: argparse.Namespace) -> ContinuousSpec | None:
    if args.engine != "continuous":
        return None
    return ContinuousSpec(
        max_num_seqs=args.max_num_seqs,
        step_ms=args.step_ms,
        step_growth=args.step_growth,
        context_ms_per_1k=args.context_ms_per_1k,
        prefill_ms_per_1k=args.prefill_ms_per_1k,
        kv_tokens=args.kv_tokens,
        scheduling=args.scheduling_policy,
    )


def _gateway_server(
    settings: Settings, log_level: str, drain_timeout_s: float, config_path: str | None = None
) -> GatewayServers:
    # Imported here so that `sim` starts without loading the gateway.
    from gateway.programs.app import build_runtime, create_app
    from gateway.server.serving import DrainingServer, QuietServer, uvicorn_config

    runtime = build_runtime(settings)
    app = create_app(settings, runtime=runtime, config_path=config_path)
    admin = settings.admin_listen

    def config_for(tls: Tls | None, lifespan: str = "on") -> uvicorn.Config:
        return uvicorn_config(
            app,
            lifespan=lifespan,
            log_level=log_level,
            limits=settings.limits,
            backend_files=settings.backend_connections(),
            registry=runtime.metrics.registry,
            admin_port=admin.port if admin is not None else None,
            tls=tls,
        )

    if admin is None or (settings.listen.tls is None and admin.tls is None):
        return GatewayServers(DrainingServer(config_for(settings.listen.tls), runtime.drain, drain_timeout_s))
    # TLS on one listener and not the other (a server's sockets share one TLS context): the admin
    # listener gets a server of its own, on the same app, loop and connection budget.
    main = DrainingServer(config_for(settings.listen.tls), runtime.drain, drain_timeout_s)
    return GatewayServers(main, QuietServer(config_for(admin.tls, lifespan="off")))


class GatewayServers:
    """The gateway's uvicorn server, and the admin listener's where it serves apart (with TLS)."""

    def __init__(self, main: uvicorn.Server, admin: uvicorn.Server | None = None) -> None:
        self.main = main
        self.admin = admin

    async def serve(self, sockets: list[socket.socket]) -> None:
        """Serve `sockets` (the client listener's, then the admin listener's) until the main server
        stops; the admin listener stops after it, so that probes are answered through the drain."""
        if self.admin is None:
            await self.main.serve(sockets)
            return
        admin_serving = asyncio.ensure_future(self.admin.serve(sockets[1:]))
        try:
            await self.main.serve(sockets[:1])
        finally:
            self.admin.should_exit = True
            await admin_serving


def _load_settings(path: str) -> Settings:
    """The config at `path`; an invalid one is reported, and the command ends with status 2."""
    from gateway.settings import ConfigError, load_settings

    try:
        return load_settings(path)
    except ConfigError as error:
        print(f"inference-gateway: invalid config {error.source}:", file=sys.stderr)
        for problem in error.problems:
            print(f"  - {problem}", file=sys.stderr)
        raise SystemExit(2) from None


def _serve(args: argparse.Namespace) -> int:
    settings = _load_settings(args.config)
    listen = settings.listen.model_copy(
        update={k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}
    )
    settings = settings.model_copy(update={"listen": listen})
    sockets = [bind(settings.listen.host, settings.listen.port)]
    if (grpc_listen := settings.grpc_listen) is not None and grpc_listen.port != 0:
        # grpc binds its own socket once the app starts: a port taken is said here, as for HTTP.
        bind(grpc_listen.host, grpc_listen.port).close()
    tls = settings.listen.tls is not None
    admin_words = ""
    if settings.admin_listen is not None:
        sockets.append(bind(settings.admin_listen.host, settings.admin_listen.port))
        # The app tells the listeners apart by port: the one bound, when the config said 0.
        admin = settings.admin_listen.model_copy(update={"port": sockets[1].getsockname()[1]})
        settings = settings.model_copy(update={"admin_listen": admin})
        admin_words = f" (admin {url_of(sockets[1], tls=admin.tls is not None)})"
    server = _gateway_server(settings, args.log_level, settings.shutdown.drain_timeout_ms / 1000, args.config)
    log.info("inference-gateway listening on %s%s", url_of(sockets[0], tls=tls), admin_words)

    async def main() -> None:
        await server.serve(sockets)

    run(main)
    return 0


def _probe(args: argparse.Namespace) -> int:
    from gateway.programs.probe import CannotProbe, probe, probe_url

    settings = _load_settings(args.config)
    path = "/readyz" if args.ready else "/healthz"
    if args.port is not None:
        listener = settings.admin_listen or settings.listen
        moved = listener.model_copy(update={"port": args.port})
        key = "admin_listen" if settings.admin_listen else "listen"
        settings = settings.model_copy(update={key: moved})
    try:
        url = probe_url(settings, path)
    except CannotProbe as error:
        print(f"inference-gateway probe: {error}", file=sys.stderr)
        return 2
    ok, line = probe(url, args.timeout_ms / 1000)
    print(line, file=sys.stdout if ok else sys.stderr)
    return 0 if ok else 1


def _sim(args: argparse.Namespace) -> int:
    from gateway.tools.model_server.server import SimOptions, build_sim

    options = SimOptions(
        host=args.host,
        port=args.port,
        metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        slots=args.slots,
        base_ms=args.base_ms,
        per_item_ms=args.per_item_ms,
        token_ms=args.token_ms,
        default_tokens=args.tokens,
        stop_on_disconnect=args.on_disconnect == "stop",
        service_dist=args.service_dist,
        seed=args.seed,
        continuous=_continuous_spec(args),
        served_model_name=args.served_model_name,
    )
    sim = build_sim(options)
    log.info("sim listening on %s (metrics %s), %d slots", sim.url, sim.metrics_url, options.slots)
    run(sim.serve)
    return 0


def demo_settings(backend_url: str, metrics_url: str | None, port: int, slots: int) -> Settings:
    from gateway.settings import parse_settings

    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "priorities": [{"name": "high", "max_wait_ms": 250}, {"name": "low", "max_wait_ms": 1000}],
        "default_priority": "low",
        "models": [
            {
                "name": "sim",
                "expected_service_ms": 40,
                "backends": [{"url": backend_url, "max_concurrency": slots, "metrics_url": metrics_url}],
            }
        ],
    }
    return parse_settings(config, "demo defaults")


_DEMO_INFER = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
_DEMO_CHAT = {
    "model": "sim",
    "stream": True,
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "hi"}],
}


def _demo(args: argparse.Namespace) -> int:
    from gateway.tools.model_server.server import SimOptions, build_sim

    sim = build_sim(SimOptions(port=0, metrics_port=0, slots=8, base_ms=40, token_ms=20), quiet=True)
    settings = demo_settings(sim.url, sim.metrics_url, args.port, slots=8)
    sock = bind(settings.listen.host, settings.listen.port)
    gateway = _gateway_server(settings, args.log_level, drain_timeout_s=5.0)
    url = url_of(sock)
    print(
        f"\ninference-gateway demo: {url} -> simulated GPU server {sim.url} (8 slots x 40 ms)\n\n"
        f"  curl -s {url}/v2/models/sim/infer -H 'X-Priority: high' \\\n"
        f"    -d '{json.dumps(_DEMO_INFER)}'\n\n"
        f"  curl -sN {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{json.dumps(_DEMO_CHAT)}'\n\n"
        f"  metrics: {url}/metrics    stop: Ctrl-C\n",
        flush=True,
    )

    async def main() -> None:
        sim_serving = asyncio.ensure_future(sim.serve())
        try:
            await gateway.serve([sock])
        finally:
            sim.stop()
            await sim_serving

    run(main)
    return 0
