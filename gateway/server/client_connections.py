"""One process's client connections: its limits, its tables of connections (the clients', and the
admin listener's apart), the counts of those it cut, and the protocol class its listeners serve with
(gateway.server.connections keeps the rules)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from gateway.server.client_limits import ClientLimits, Cut
from gateway.server.connection_table import ConnectionTable
from gateway.server.connections import LimitedHttpToolsProtocol

if TYPE_CHECKING:
    from gateway.settings import Limits

ADMIN_CONNECTIONS = 32
"""Connections the admin listener holds at most, apart from the clients' `max_connections`."""


class ClientConnections:
    """One process's client limits, its tables of connections, and counts of the ones it cut; a
    prometheus collector of them (registering it again in the same registry changes nothing)."""

    def __init__(self, limits: ClientLimits) -> None:
        self.limits = limits
        self.table: ConnectionTable[LimitedHttpToolsProtocol] = ConnectionTable(limits.max_connections)
        self.admin_table: ConnectionTable[LimitedHttpToolsProtocol] = ConnectionTable(ADMIN_CONNECTIONS)
        self.admin_port: int | None = None
        """The admin listener's port (bound), whose connections count in `admin_table`."""
        self.cuts = dict.fromkeys(Cut, 0)
        # For uvicorn.Config(http=...): every listener of the process gets the same class.
        self.protocol = type("LimitedHttpToolsProtocol", (LimitedHttpToolsProtocol,), {"clients": self})

    def count(self, cut: Cut) -> None:
        self.cuts[cut] += 1

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "gateway_client_connections",
            "Client connections open, every listener together (the admin listener's too).",
            len(self.table) + len(self.admin_table),
        )
        yield GaugeMetricFamily(
            "gateway_client_connections_max",
            "Client connections held at most (limits.max_connections, or from the open-file limit).",
            value=self.limits.max_connections,
        )
        closed = CounterMetricFamily(
            "gateway_client_connections_closed",
            "Client connections the gateway closed for a limit (its 431 and 400 answers included), by limit.",
            labels=["reason"],
        )
        for cut, count in self.cuts.items():
            closed.add_metric([cut.value], count)
        yield closed


_process_connections: ClientConnections | None = None


def process_connections(limits: Limits, backend_files: int = 0) -> ClientConnections:
    """The process's one ClientConnections, made on first use: every listener shares it, as they
    share the process's open-file limit."""
    global _process_connections
    wanted = ClientLimits.from_settings(limits, backend_files=backend_files)
    if _process_connections is None:
        _process_connections = ClientConnections(wanted)
    elif _process_connections.limits != wanted:
        raise ValueError(f"client limits are set once per process: {_process_connections.limits}")
    return _process_connections
