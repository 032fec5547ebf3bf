"""Replicas that go absent from Redis, step by step on an injected Redis clock: a lease is renewed
by the work it covers, an absent replica's leases stay reserved until its work could have ended
(and up to its fallback's share of them until its fallback's time has run out too), it cannot beat,
take or free anything until it rejoins, and its rejoining replaces the reservation by its work."""

from __future__ import annotations

import asyncio

import pytest

from gateway.queues.base import Flow, Granted, Queued, Slot
from gateway.queues.redis.peers import BeaconAt
from gateway.queues.redis.presence import ReplicaAbsent
from gateway.queues.redis.store import RedisQueue
from gateway.upstream.backends import BackendState, ModelPool
from gateway.upstream.origin import OnAbandon
from tests.contract.redis_cluster import (
    BOUND_S,
    FALLBACK_MAX_S,
    HOLD_S,
    MODEL,
    SHARE,
    SLOTS,
    TTL_S,
    pool,
)

pytestmark = [pytest.mark.anyio, pytest.mark.redis]


async def take(store: RedisQueue) -> Slot:
    offer = await store.offer(Flow(MODEL, 0), 1.0, 5.0, 100.0, 0.0)
    assert isinstance(offer, Granted), offer
    return offer.slot


async def free_slots_seen_by(store: RedisQueue) -> int:
    await store._refresh(store._models[MODEL])
    return store.stats(MODEL).free_slots


async def test_a_lease_in_use_is_renewed_past_the_ttl_and_one_whose_release_was_lost_lapses(cluster):
    a = await cluster.start("a")
    used, lost = await take(a), await take(a)
    a._models[MODEL].let_go(lost)  # its request ended, and its release never reached Redis
    lost.released = True
    for _ in range(3):
        cluster.now += TTL_S / 2
        await cluster.beat(a)
        await cluster.reap(a)
    assert await cluster.leases("a") == {used.lease}
    assert await cluster.expiry(used.lease) == cluster.now + TTL_S
    assert await cluster.slots_in_use() == 1


async def test_an_absent_replicas_leases_stay_reserved_until_its_work_could_have_ended(cluster):
    a, b = await cluster.start("a"), await cluster.start("b")
    beat_at = cluster.now
    a_slots = [await take(a) for _ in range(SHARE + 1)]  # one more than its fallback's share
    assert await free_slots_seen_by(b) == SLOTS - SHARE - 1

    await cluster.advance_to(cluster.now + TTL_S + 1, beating=b)  # a's lapses (cut off, or dead)
    assert await cluster.leases("a") == {slot.lease for slot in a_slots}, "reaped at the TTL"
    assert await free_slots_seen_by(b) == SLOTS - SHARE - 1

    # The one beyond its share only until its request is surely over (upstream timeout + a TTL).
    await cluster.advance_to(beat_at + BOUND_S + 1, beating=b)
    assert await free_slots_seen_by(b) == SLOTS - SHARE
    # Its share for as long as its fallback may start work, and that work run.
    await cluster.advance_to(beat_at + HOLD_S - 1, beating=b)
    assert await free_slots_seen_by(b) == SLOTS - SHARE
    await cluster.advance_to(beat_at + HOLD_S + 1, beating=b)
    assert await free_slots_seen_by(b) == SLOTS
    assert await cluster.leases("a") == set()
    assert isinstance(await b.offer(Flow(MODEL, 0), 1.0, 5.0, 100.0, 0.0), Granted)


async def test_without_a_fallback_an_absent_replicas_leases_are_held_until_their_bounds_only(cluster):
    a, b = await cluster.start("a", fallback_max_s=0.0), await cluster.start("b")
    granted_at = cluster.now
    await take(a)
    await cluster.advance_to(cluster.now + TTL_S + 1, beating=b)
    assert await free_slots_seen_by(b) == SLOTS - 1
    await cluster.advance_to(granted_at + BOUND_S + 1, beating=b)
    assert await free_slots_seen_by(b) == SLOTS


async def test_an_absent_replica_can_neither_beat_nor_take_nor_free_until_it_rejoins(cluster):
    a, b = await cluster.start("a"), await cluster.start("b")
    kept, ended = await take(a), await take(a)
    await cluster.advance_to(cluster.now + TTL_S + 1, beating=b)

    with pytest.raises(ReplicaAbsent):
        await cluster.beat(a)
    with pytest.raises(ReplicaAbsent):
        await a.offer(Flow(MODEL, 0), 1.0, 5.0, 100.0, 0.0)
    await a.release(ended, 0.0)  # a late release: its fallback may be reusing the slot
    assert await cluster.leases("a") == {kept.lease, ended.lease}

    await a.rejoin({})  # its work replaces the reservation: the lease it still uses, nothing more
    assert await cluster.leases("a") == {kept.lease}
    assert await cluster.expiry(kept.lease) == cluster.now + TTL_S
    assert await free_slots_seen_by(b) == SLOTS - 1
    await cluster.beat(a)  # live again
    assert isinstance(await a.offer(Flow(MODEL, 0), 1.0, 5.0, 100.0, 0.0), Granted)


async def test_grants_an_absent_replica_never_took_are_freed_when_it_is_reaped(cluster):
    b = await cluster.start("b")
    a = cluster.replica("a")  # joined, but its grant listener never runs
    await a._presence.join(a._models[MODEL], {})
    held = [await take(b) for _ in range(SLOTS)]
    queued = await a.offer(Flow(MODEL, 0), 1.0, 5.0, 100.0, 0.0)
    assert isinstance(queued, Queued)
    await b.release(held[0], 0.0)  # granted to a's ticket, onto a's list
    assert await cluster.client.llen(f"{cluster.tag}:grants:a") == 1
    await cluster.advance_to(cluster.now + TTL_S + 1, beating=b)
    assert await cluster.leases("a") == set()
    assert await free_slots_seen_by(b) == 1


async def test_a_replica_that_leaves_holds_no_fallback_share(cluster):
    a, b = await cluster.start("a"), await cluster.start("b")
    granted_at = cluster.now
    await take(a)  # cut short by the shutdown: its request may still run to its bound
    await cluster.stop(a)
    assert await free_slots_seen_by(b) == SLOTS - 1
    await cluster.advance_to(granted_at + BOUND_S + 1, beating=b)  # long before a fallback's time
    assert await free_slots_seen_by(b) == SLOTS


async def test_a_new_state_presumes_the_fallback_share_of_replicas_it_does_not_know(cluster):
    await cluster.client.delete(f"{cluster.tag}:stats")  # as after Redis lost what it held
    a = await cluster.start("a")
    joined_at = cluster.now
    assert await free_slots_seen_by(a) == SLOTS - SHARE  # the other expected replica's share
    await cluster.advance_to(joined_at + FALLBACK_MAX_S + BOUND_S + 1, beating=a)
    assert await free_slots_seen_by(a) == SLOTS
    b = await cluster.start("b")
    cluster.now = joined_at
    assert await free_slots_seen_by(b) == SLOTS, "both expected replicas are live"


async def wipe(cluster) -> None:
    """Redis restarted without persistence: everything the replicas shared is gone."""
    keys = [key async for key in cluster.client.scan_iter(match=f"{cluster.tag}*")]
    await cluster.client.delete(*keys)


@pytest.mark.parametrize(
    ("taken", "kept", "reserve"), [(4, (0, 1, 2, 3), 0), (2, (0, 1), 1), (4, (1, 3), 0), (4, (2, 3), 1)]
)
async def test_leases_redis_forgot_are_all_counted_again_whatever_ids_the_new_state_hands_out(
    cluster, taken, kept, reserve
):
    """A new state counts lease ids from 1 again: the kept leases' old ids collide with the ids
    it issues to the ones it counts again, and to the fallback's reservation."""
    a = await cluster.start("a")
    slots = [await take(a) for _ in range(taken)]
    for index, slot in enumerate(slots):
        if index not in kept:
            await a.release(slot, 0.0)
    await a.settle()
    held = [slots[index] for index in kept]
    await wipe(cluster)
    a._presence.detached = True  # as its failed heartbeat would have found
    backend = "http://127.0.0.1:9000"  # redis_cluster.pool()'s
    await a.rejoin({MODEL: {backend: reserve}} if reserve else {})
    assert await cluster.slots_in_use() == len(held) + reserve
    leases = await cluster.leases("a")
    assert {slot.lease for slot in held} <= leases and len(leases) == len(held) + reserve
    assert len({slot.lease for slot in held}) == len(held)


async def test_after_redis_lost_its_state_an_unknown_replica_may_run_anything_until_it_could_have_rejoined(
    cluster,
):
    """The other replica ran the whole backend, not its share, when Redis lost its state: the one
    that rejoins first must not fill the backend again before the other could have rejoined."""
    a = await cluster.start("a")
    b = await cluster.start("b")
    for _ in range(SLOTS):
        await take(b)
    await wipe(cluster)
    a._presence.detached = True
    await a.rejoin({})
    assert await free_slots_seen_by(a) == 0  # b may still run all of it
    await cluster.advance_to(cluster.now + TTL_S + 1, beating=a)
    assert await free_slots_seen_by(a) == SLOTS - SHARE  # then at most its fallback's share
    b._presence.detached = True
    await b.rejoin({})
    assert await free_slots_seen_by(a) == 0  # its work, counted again


async def offer_left_while_its_script_runs(store: RedisQueue) -> None:
    """The offer's script has run in Redis, and its caller leaves while the reply is on its way."""
    run, ran, reply_back = store._run, asyncio.Event(), asyncio.Event()

    async def reply_late(script: str, state, args):  # type: ignore[no-untyped-def]
        reply = await run(script, state, args)
        if script == "offer":
            ran.set()
            await reply_back.wait()
        return reply

    store._run = reply_late  # type: ignore[method-assign]
    offer = asyncio.ensure_future(store.offer(Flow(MODEL, 0), 1.0, 5.0, 100.0, 0.0))
    await ran.wait()
    offer.cancel()
    with pytest.raises(asyncio.CancelledError):
        await offer
    reply_back.set()
    store._run = run  # type: ignore[method-assign]
    await store.settle()


async def test_a_slot_granted_to_an_offer_whose_caller_left_goes_back(cluster):
    a = await cluster.start("a")
    await offer_left_while_its_script_runs(a)
    assert await cluster.slots_in_use() == 0
    assert await cluster.leases("a") == set()


async def test_a_ticket_queued_for_an_offer_whose_caller_left_takes_no_slot(cluster):
    a = await cluster.start("a")
    held = [await take(a) for _ in range(SLOTS)]
    await offer_left_while_its_script_runs(a)
    await a.release(held[0], 0.0)
    await a.settle()
    assert await cluster.slots_in_use() == SLOTS - 1  # the slot went to nobody


async def probed(store: RedisQueue) -> None:
    """`store`'s probes of the absent replicas' beacons, to their end (as its upkeep starts them)."""
    store._peers._probed_at.clear()  # the rig's clock is not the one probes are spaced by
    store._peers.look(store._models[MODEL])
    await store.settle()


@pytest.mark.parametrize("on_abandon", [OnAbandon.ABORT, OnAbandon.DRAIN])
async def test_a_replica_whose_beacon_is_gone_gives_its_slots_back_as_soon_as_its_backend_stopped(
    cluster, on_abandon
):
    beacon = BeaconAt("127.0.0.1", 0)
    a = await cluster.start("a", model=pool(on_abandon), beacon_at=beacon)
    b = await cluster.start("b", model=pool(on_abandon), beacon_at=beacon)
    [await take(a) for _ in range(SHARE + 1)]
    await cluster.advance_to(cluster.now + TTL_S + 1, beating=b)  # a's heartbeat lapses
    await probed(b)  # its beacon answers: alive, cut off from Redis, maybe serving from its fallback
    assert await free_slots_seen_by(b) == SLOTS - SHARE - 1

    await a._peers.close()  # killed: its port refuses
    await probed(b)
    if on_abandon is OnAbandon.ABORT:  # its connections closed with it, and the backend stopped
        assert await free_slots_seen_by(b) == SLOTS
        assert await cluster.leases("a") == set()
    else:  # the backend computes on, each request at most its measured bound (and a TTL) more
        assert await free_slots_seen_by(b) == SLOTS - SHARE - 1
        drain_s = a._presence._identity_args(a._models[MODEL])["peer"]["d"]
        assert drain_s < BOUND_S
        await cluster.advance_to(cluster.now + drain_s / 2, beating=b)
        assert await free_slots_seen_by(b) == SLOTS - SHARE - 1
        await cluster.advance_to(cluster.now + drain_s, beating=b)
        assert await free_slots_seen_by(b) == SLOTS
    assert await cluster.client.hget(f"{cluster.tag}:peer", "a") is None


async def test_a_replica_without_a_beacon_or_back_in_redis_is_never_taken_for_gone(cluster):
    a = await cluster.start("a", model=pool(OnAbandon.ABORT))  # no beacon: nothing to probe
    b = await cluster.start("b", model=pool(OnAbandon.ABORT), beacon_at=BeaconAt("127.0.0.1", 0))
    await take(a)
    await cluster.advance_to(cluster.now + TTL_S + 1, beating=b)
    await probed(b)
    assert await free_slots_seen_by(b) == SLOTS - 1
    # Live again: the script leaves a rejoined replica's leases alone, whatever a probe said.
    await a.rejoin({})
    reply = await b._run("gone", b._models[MODEL], {"replica": "a", "abort": ["http://127.0.0.1:9000"]})
    assert reply == {"freed": 0, "granted": 0}
    assert await free_slots_seen_by(b) == SLOTS - 1


async def test_a_live_replica_whose_grants_stay_untaken_and_whose_beacon_is_gone_is_reaped_at_once(cluster):
    # Killed a moment ago, its heartbeat not yet lapsed: every slot freed meanwhile is handed to its
    # queued tickets and lost until the lapse, unless a peer notices the grants it does not take.
    beacon = BeaconAt("127.0.0.1", 0)
    b = await cluster.start("b", model=pool(OnAbandon.ABORT), beacon_at=beacon)
    a = cluster.replica("a", model=pool(OnAbandon.ABORT), beacon_at=beacon)  # its listener never runs
    a._presence.beacon = await a._peers.open()
    await a._presence.join(a._models[MODEL], {})
    await take(a)
    held = [await take(b) for _ in range(SLOTS - 1)]
    assert isinstance(await a.offer(Flow(MODEL, 0), 1.0, 5.0, 100.0, 0.0), Queued)
    await b.release(held[0], 0.0)  # granted to a's ticket, onto a's list
    await probed(b)  # the first look at its list's head
    await probed(b)  # the same head: its beacon answers, alive, only slow to take it
    assert await free_slots_seen_by(b) == 0

    await a._peers.close()
    await probed(b)  # the same head, and its beacon refuses
    assert await cluster.leases("a") == set()
    assert await free_slots_seen_by(b) == 2  # its request's slot, and the grant it never took
    assert await cluster.client.llen(f"{cluster.tag}:grants:a") == 0


async def test_a_state_found_on_another_redis_process_is_dropped_and_the_work_running_counted_again(cluster):
    # A replica promoted by Sentinel (or Cluster) holds what the old master had replicated, and
    # maybe not its last grants: the state it carries names the process it was written on.
    a, b = await cluster.start("a"), await cluster.start("b")
    running = [await take(a) for _ in range(2)]
    await cluster.client.set(f"{cluster.tag}:server", "the-old-master's-run-id")

    with pytest.raises(ReplicaAbsent):  # the first script on the new process drops the state
        await cluster.beat(a)
    assert await cluster.leases("a") == set()
    await a._presence.rejoin_as_it_is(a._models[MODEL])  # as its upkeep does
    assert len(await cluster.leases("a")) == len(running)  # counted again, under new ids
    # Until b has rejoined too, it is presumed to run all of the backend (it may have run anything).
    await cluster.reap(a)
    assert await free_slots_seen_by(a) == 0
    with pytest.raises(ReplicaAbsent):
        await cluster.beat(b)
    await b._presence.rejoin_as_it_is(b._models[MODEL])
    assert await free_slots_seen_by(b) == SLOTS - len(running)


async def test_with_many_slots_in_use_a_fresh_view_is_not_sent_the_work_in_flight_again(cluster):
    # Each lease in flight costs a view a read and a reply: with more than a few dozen, a script
    # leaves them out where the replica's own view is a few milliseconds old; it keeps its own.
    many = 80  # above lua/common.lua's LEASES_ALWAYS_SENT
    backend = BackendState(MODEL, "http://127.0.0.1:9000", 100, "/v2/health/ready", ready=True)
    big = ModelPool(MODEL, [backend], expected_service_s=0.04)
    a = await cluster.start("a", model=big)
    local = [1000.0]
    a._clock = lambda: local[0]
    slots = [await take(a) for _ in range(many)]
    await a._refresh(a._models[MODEL])  # a full view: every lease's grant time
    assert len(a.stats(MODEL).started_at) == many
    slots.append(await take(a))  # its view fresh: the reply leaves them out, the replica keeps its own
    stats = a.stats(MODEL)
    assert len(stats.started_at) == many and stats.free_slots == 100 - many - 1
    local[0] += 0.1  # no longer fresh: the next reply brings them all
    slots.append(await take(a))
    assert len(a.stats(MODEL).started_at) == many + 2
