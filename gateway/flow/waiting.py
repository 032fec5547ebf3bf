"""A queued request's wait for its slot: the grant, its leave-by time or its client's leaving,
whichever comes first."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from gateway.queues.base import RequestQueue, Slot, Ticket
from policies.outcomes import Outcome


async def wait_for_slot(
    store: RequestQueue, ticket: Ticket, timeout_s: float, until_disconnect: Callable[[], Awaitable[object]]
) -> Slot | Outcome:
    """The slot granted to `ticket` within `timeout_s`, or why its wait ended; a ticket that leaves
    is withdrawn (a slot granted in the same instant goes straight back to the pool)."""
    loop = asyncio.get_running_loop()
    timer = loop.call_later(max(0.0, timeout_s), store.expire, ticket)
    watcher: asyncio.Future[object] | None = None
    result: Slot | Outcome = Outcome.CLIENT_DISCONNECTED
    try:
        # Inside: the call's hook that starts the watch may raise, and the ticket must not stay.
        watcher = asyncio.ensure_future(until_disconnect())
        watcher.add_done_callback(lambda _: ticket.interrupt(Outcome.CLIENT_DISCONNECTED))
        result = await ticket.wakeup
        return result
    finally:
        timer.cancel()
        if watcher is not None:
            watcher.cancel()
        if not isinstance(result, Slot):
            await store.withdraw(ticket, result)
