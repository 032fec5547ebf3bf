"""The drain: it waits for the counted requests up to its timeout, then cuts them; a cut is a
cancellation each request may take back once to answer, and the admitted call answers it without
leaking its ticket or its slot."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

import pytest

from gateway.flow.controller import Lease
from gateway.flow.drain import DRAINING_RETRY_S, Drain
from policies.outcomes import Outcome
from tests.eventually import eventually
from tests.unit.test_admitted_call import Ingress, Rig, Work, answers

pytestmark = pytest.mark.anyio


def counted(drain: Drain, work: Awaitable[object]) -> asyncio.Task[object]:
    """`work` as a request: in a task of its own, counted by `drain` from start to end."""

    async def request() -> object:
        drain.started()
        try:
            return await work
        finally:
            drain.finished()

    return asyncio.ensure_future(request())


async def answers_the_cut(drain: Drain, wait: Awaitable[object]) -> str:
    """A request stage that turns the drain's cut into its answer, as the ingress does."""
    try:
        await wait
    except asyncio.CancelledError:
        if not drain.absorb_cut():
            raise
        await asyncio.sleep(0)  # taken back: it can still await, to send its answer
        return "answered the cut"
    return "finished"


async def test_the_drain_ends_when_the_last_request_does():
    drain = Drain()
    release = asyncio.Event()
    request = counted(drain, release.wait())
    await asyncio.sleep(0)
    waiting = asyncio.ensure_future(drain.drain(5.0))
    await asyncio.sleep(0)
    assert drain.draining and not waiting.done()
    release.set()
    assert await asyncio.wait_for(waiting, 1.0) is True
    await request


async def test_the_drain_gives_up_at_its_timeout_without_cutting():
    drain = Drain()
    request = counted(drain, asyncio.Event().wait())
    await asyncio.sleep(0)
    assert await drain.drain(0.05) is False
    assert (drain.active, drain.cut_short, request.done()) == (1, False, False)
    drain.cut()
    with pytest.raises(asyncio.CancelledError):
        await request


async def test_a_cut_ends_the_wait_at_once_and_each_request_answers_it_once():
    drain = Drain()
    requests = [counted(drain, answers_the_cut(drain, asyncio.Event().wait())) for _ in range(3)]
    await asyncio.sleep(0)
    waiting = asyncio.ensure_future(drain.drain(60.0))
    await asyncio.sleep(0)
    assert drain.cut() == 3
    assert drain.cut() == 0  # only the first call cuts
    assert await asyncio.wait_for(waiting, 1.0) is False
    assert await asyncio.gather(*requests) == ["answered the cut"] * 3
    assert await drain.settle(1.0) is True
    assert drain.active == 0


async def test_a_cancellation_that_is_not_the_cut_is_not_taken_back():
    drain = Drain()
    request = counted(drain, answers_the_cut(drain, asyncio.Event().wait()))
    await asyncio.sleep(0)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request


async def test_a_cut_is_taken_back_once_and_a_later_cancellation_still_cancels():
    drain = Drain()
    answered = asyncio.Event()

    async def answers_then_waits() -> None:
        assert await answers_the_cut(drain, asyncio.Event().wait()) == "answered the cut"
        answered.set()
        await answers_the_cut(drain, asyncio.Event().wait())  # the server's own cancel, later

    request = counted(drain, answers_then_waits())
    await asyncio.sleep(0)
    drain.cut()
    await asyncio.wait_for(answered.wait(), 1.0)
    await asyncio.sleep(0)  # it is waiting again, not cancelled again
    assert not request.done()
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request


async def test_a_request_that_arrives_after_the_cut_is_cut_at_its_first_wait():
    drain = Drain()
    drain.cut()
    request = counted(drain, answers_the_cut(drain, asyncio.Event().wait()))
    assert await asyncio.wait_for(request, 1.0) == "answered the cut"


async def test_settle_says_when_cut_requests_do_not_end():
    drain = Drain()

    async def ignores_the_cut() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            drain.absorb_cut()
            await asyncio.Event().wait()

    request = counted(drain, ignores_the_cut())
    await asyncio.sleep(0)
    drain.cut()
    assert await drain.settle(0.05) is False
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request


# The admitted call under the cut: the rig of tests/unit/test_admitted_call.py (the memory store,
# the real controller, a scripted work and ingress) with each call run as a counted request.


class AnswersForever(Ingress):
    """An ingress whose backend never answers: its call holds the slot until the work is done."""

    async def answer(self, lease: Lease) -> Outcome:
        await asyncio.Event().wait()
        return Outcome.OK


async def test_a_queued_call_cut_by_the_drain_is_withdrawn_refused_and_counted_draining():
    rig = Rig(slots=1)
    drain = rig.admission.drain
    holder, holder_work = AnswersForever(answers(Outcome.OK)), Work()
    queued = Ingress(answers(Outcome.OK))
    running = counted(drain, rig.call(holder_work, holder).run())
    waiting = counted(drain, rig.call(Work(), queued).run())
    await eventually(lambda: rig.store.stats("m").queued_by_band[0] == 1, what="the second call to queue")
    assert drain.cut() == 2
    await asyncio.wait_for(asyncio.gather(running, waiting), 1.0)
    assert [(r.outcome, r.retry_after_s) for r in queued.refused] == [(Outcome.DRAINING, DRAINING_RETRY_S)]
    assert rig.store.stats("m").queued_by_band[0] == 0
    assert rig.counted(Outcome.DRAINING) == 2
    assert rig.counted(Outcome.CLIENT_DISCONNECTED) == 0
    # The cut call's work was closed; its slot goes back when the backend is done, not before.
    assert (holder_work.closed, rig.free) == (1, 0)
    holder_work.finish()
    assert rig.free == 1
