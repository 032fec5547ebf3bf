"""Backend health: active probes of each backend's readiness path, and passive health from the data
path (a circuit per backend, policies.circuit). The store hears of every change (`on_change`).

Its rules:
- a backend is ready when its last probes passed and its circuit is not open. Probes never close
  a circuit: a half-hung backend passes them while its inference hangs;
- a circuit opens on failures in a row (`judge`, the Forwarder's `on_verdict`, called before the
  slot of the exchange goes back) or on a stall: requests in flight and no byte of any of their
  answers for `stall_timeout_s` (watched every `look_s`, beside the probes);
- a stalled backend's requests are given up at once: their clients are answered 504 and each
  exchange ends as the backend's `on_abandon` says, which is when its slot frees (abort: we close
  the connection and the slot frees when the backend closes its side, or at the hard upstream
  timeout if it never does; drain: when the answer ends, or at that timeout). Freeing a slot
  earlier would let a backend that wakes up run more than its `max_concurrency`;
- an open circuit half-opens after its cool-down once the backend holds none of our slots; then
  its `max_concurrency` is 1, so the stores send it one trial request, whose verdict closes the
  circuit (all its slots again) or opens it for another cool-down.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import aiohttp
import anyio
from anyio.abc import TaskStatus

from gateway.settings import Health
from gateway.upstream.backends import BackendState, ModelPool
from gateway.upstream.origin import tls_context
from gateway.upstream.reply import BackendStalled

if TYPE_CHECKING:  # grpc is imported where a model is decoupled, not by every gateway
    from gateway.upstream.streamed import GrpcChannels
from policies.circuit import (
    Cause,
    Circuit,
    CircuitRules,
    CircuitState,
    Verdict,
    admits,
    after_stall,
    after_verdict,
    after_wait,
    cooldown_left_s,
    stalled,
    watch_quiet,
)

log = logging.getLogger("gateway.health")

_DEFAULT_RULES = CircuitRules()


class HealthChecker:
    """Built before serving; its probes take the session the lifespan opens (`check_all`, `run`)."""

    def __init__(
        self,
        pools: Sequence[ModelPool],
        on_change: Callable[[str], None],
        *,
        interval_s: float,
        timeout_s: float,
        failures_to_down: int = 2,
        circuit: CircuitRules = _DEFAULT_RULES,
        stall_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        grpc_channels: GrpcChannels | None = None,
    ) -> None:
        """`grpc_channels`: where a decoupled model's backends are also asked over gRPC, the port
        its requests go to (gateway.upstream.streamed)."""
        self._grpc_channels = grpc_channels
        self._pools = pools
        self._on_change = on_change
        self._interval_s = interval_s
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        # One slow probe on a busy host is not a dead backend: it takes this many in a row.
        self._failures_to_down = failures_to_down
        self._rules = circuit
        self._stall_s = stall_timeout_s
        self._clock = clock
        # A stall is found, and a cool-down noticed, at most this late.
        self.look_s = max(0.01, min(1.0, stall_timeout_s / 4, circuit.cooldown_s / 4))

    def ready_again_in_s(self, pool: ModelPool) -> float:
        """When a backend of `pool`, none of which is ready, may be ready again at the soonest: an
        open circuit at the end of its cool-down, any other at the next probe."""
        now = self._clock()
        return min(
            (cooldown_left_s(b.circuit, self._rules, now) or self._interval_s for b in pool.backends),
            default=self._interval_s,
        )

    @classmethod
    def from_settings(
        cls,
        pools: Sequence[ModelPool],
        on_change: Callable[[str], None],
        health: Health,
        *,
        clock: Callable[[], float] = time.monotonic,
        grpc_channels: GrpcChannels | None = None,
    ) -> HealthChecker:
        return cls(
            pools,
            on_change,
            interval_s=health.interval_ms / 1000,
            timeout_s=health.timeout_ms / 1000,
            failures_to_down=health.failures_to_down,
            circuit=CircuitRules(health.passive_failures_to_open, health.cooldown_ms / 1000),
            stall_timeout_s=health.stall_timeout_ms / 1000,
            clock=clock,
            grpc_channels=grpc_channels,
        )

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        """Probe every backend once, concurrently."""
        await asyncio.gather(*(self._check(session, pool, b) for pool in self._pools for b in pool.backends))

    async def run(
        self, session: aiohttp.ClientSession, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED
    ) -> None:
        """Probe every `interval_s` and watch the circuits every `look_s`, until cancelled."""
        async with anyio.create_task_group() as group:
            group.start_soon(self._watch)
            task_status.started()
            while True:
                await asyncio.sleep(self._interval_s)
                await self.check_all(session)

    def mark_unreachable(
        self, pool: ModelPool, backend: BackendState, reason: str = "a request could not reach it"
    ) -> None:
        """Passive check: a connection to the backend failed, so stop dispatching to it now."""
        self._set(pool, backend, ready=False, reason=reason)

    def judge(self, pool: ModelPool, backend: BackendState, verdict: Verdict) -> None:
        """Passive check: an exchange with `backend` ended with `verdict` (before its slot goes back)."""
        self._move(pool, backend, after_verdict(backend.circuit, verdict, self._rules, self._clock()))

    def look(self) -> None:
        """Find stalled backends, and half-open the circuits whose cool-down is over."""
        now = self._clock()
        for pool in self._pools:
            for backend in list(pool.backends):
                self._look_at(pool, backend, now)

    def _look_at(self, pool: ModelPool, backend: BackendState, now: float) -> None:
        flight = backend.in_flight
        owed_nothing = all(reply.waits_on_reader for reply in flight.replies)
        backend.quiet = quiet = watch_quiet(
            backend.quiet, flight.answer_events, flight.busy_since, now, owed_nothing=owed_nothing
        )
        if admits(backend.circuit) and stalled(quiet, now, self._stall_s):
            assert quiet.since is not None, "a stalled backend has been quiet since some time"
            self._stalled(pool, backend, now - quiet.since)
        else:
            self._move(pool, backend, after_wait(backend.circuit, self._rules, now, backend.inflight))

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.look_s)
            self.look()

    def _stalled(self, pool: ModelPool, backend: BackendState, quiet_s: float) -> None:
        replies = list(backend.in_flight.replies)
        detail = f"no byte of any answer for {quiet_s:.1f} s with {len(replies)} request(s) in flight"
        # Out of dispatch first: the slots these give-ups free must not go to waiters for it.
        self._move(pool, backend, after_stall(backend.circuit, self._clock()), detail)
        error = BackendStalled(f"backend {backend.url} stalled: {detail}")
        for reply in replies:
            reply.give_up(error)

    def _move(self, pool: ModelPool, backend: BackendState, circuit: Circuit, detail: str = "") -> None:
        before, backend.circuit = backend.circuit, circuit
        if circuit.state is before.state:
            return
        where = f"backend {backend.url} of model {pool.name}"
        if circuit.state is CircuitState.OPEN:
            why = detail or (
                "its trial request failed"
                if before.state is CircuitState.HALF_OPEN
                else f"{self._rules.failures_to_open} failed requests in a row"
            )
            reason = f"its circuit is open ({why}), a trial after {self._rules.cooldown_s:g} s"
            if backend.ready:
                self._apply(pool, backend, False, reason)
            else:
                log.warning("%s: %s", where, reason)
        elif circuit.state is CircuitState.HALF_OPEN:
            log.info("%s: circuit half-open, one trial request", where)
            self._apply(pool, backend, backend.probed_ready, "its health checks fail")
        else:
            log.info("%s: circuit closed, its trial request succeeded", where)
            self._on_change(pool.name)  # all its slots again, not the trial's one

    async def _check(self, session: aiohttp.ClientSession, pool: ModelPool, backend: BackendState) -> None:
        refused = False
        url = backend.url + backend.health_path
        try:
            context = self._tls_of(backend)
            async with session.get(url, timeout=self._timeout, ssl=context) as reply:
                ready, reason = reply.status == 200, f"{url} answered {reply.status}"
        except aiohttp.ClientConnectorError as error:
            ready, refused = False, True  # nothing listens there: down at once
            reason = f"cannot connect to {url}: {error.os_error.strerror or error}"
        except TimeoutError:
            ready, reason = False, f"{url} did not answer within {self._timeout.total} s"
        except aiohttp.ClientError as error:
            ready, reason = False, f"{url} failed: {type(error).__name__}"
        except (OSError, ssl.SSLError) as error:  # its CA or certificate files cannot be read
            tls = backend.connection.tls
            files = ", ".join(f for f in (tls.ca_file, tls.cert_file, tls.key_file) if f)
            ready, reason = False, f"its tls settings cannot be used ({files}): {error}"
        if ready and pool.decoupled and self._grpc_channels is not None:
            ready, refused, reason = await self._grpc_ready(backend, self._grpc_channels)
        backend.failed_probes = 0 if ready else backend.failed_probes + 1
        if ready or refused or backend.failed_probes >= self._failures_to_down or not backend.probed_ready:
            self._set(pool, backend, ready, reason)

    async def _grpc_ready(self, backend: BackendState, channels: GrpcChannels) -> tuple[bool, bool, str]:
        """A decoupled model's backend asked on its gRPC port, where its requests go: (ready,
        refused, why)."""
        import grpc
        from tritonclient.grpc import service_pb2

        target, model = backend.grpc_target, backend.served_model or backend.model
        try:
            stub = channels.stub(backend)
            request = service_pb2.ModelReadyRequest(name=model)
            answer = await stub.ModelReady(request, timeout=self._timeout.total)
        except grpc.aio.AioRpcError as error:
            refused = error.code() is grpc.StatusCode.UNAVAILABLE  # nothing listens there: down at once
            return False, refused, f"its gRPC port {target} failed: {error.code().name}"
        except (OSError, ValueError) as error:  # no channel could be made (its TLS files)
            return False, False, f"its gRPC port {target} cannot be called: {error}"
        return (
            answer.ready,
            False,
            f"its gRPC port {target} says {model} is {'' if answer.ready else 'not '}ready",
        )

    def _tls_of(self, backend: BackendState) -> ssl.SSLContext | bool:
        """How a probe of `backend` checks its certificate: as its requests do, over https."""
        return tls_context(backend.connection.tls) if backend.url.startswith("https://") else True

    def _set(self, pool: ModelPool, backend: BackendState, ready: bool, reason: str) -> None:
        """What the probes say; the backend is ready only if its circuit agrees."""
        if ready and backend.known_slots == 0:  # a Triton backend's slots come from discovery
            ready, reason = False, "its slots are not known yet (model config not read)"
        backend.probed_ready = ready
        if ready and not admits(backend.circuit):
            cause = "it stalled" if backend.circuit.cause is Cause.STALL else "its requests failed"
            ready, reason = False, f"its circuit is open ({cause})"
        self._apply(pool, backend, ready, reason)

    def _apply(self, pool: ModelPool, backend: BackendState, ready: bool, reason: str) -> None:
        if backend.ready == ready and backend.judged:
            return
        backend.judged = True
        changed = backend.ready != ready
        backend.ready = ready
        if ready:
            log.info("backend %s of model %s is ready", backend.url, pool.name)
        else:
            log.warning("backend %s of model %s is not ready: %s", backend.url, pool.name, reason)
        if changed:
            self._on_change(pool.name)
