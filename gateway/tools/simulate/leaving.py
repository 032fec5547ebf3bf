"""Requests that leave the simulator's queue before their turn: they expire, or are displaced.

Both are misses for the flow's calibration, as in the gateway (gateway/flow/controller.py), and
leave their entry in its heap until it reaches the top (lazy deletion, as in the memory store).
"""

from __future__ import annotations

import itertools

from gateway.tools.simulate.admitting import Admitting
from gateway.tools.simulate.flows import Entry, Flow, follow_head
from policies.displacement import OVERDUE_CHECKED, displacement_handovers_per_s, overdue_in_flow


def leave_queue(
    seq: int,
    waiting: dict[int, Entry],
    gone: set[int],
    depth: list[int],
    work: list[float],
    vtime: list[float],
    admitting: Admitting,
) -> Flow:
    """Take the admitted request `seq` out of the queue before its turn (it expired, or was
    displaced), as a miss for its flow's calibration; it stays in its heap until it reaches the top
    (lazy deletion); the flow's next request becomes its head, tagged as it does. Returns its flow."""
    entry = waiting[seq]
    gone.add(seq)
    flow, cost = entry[5], entry[3]
    if seq == flow.head:
        follow_head(flow, gone, vtime[flow.band])
    del flow.live[seq]
    flow.queued -= cost
    depth[flow.band] -= 1
    work[flow.band] = work[flow.band] - cost if depth[flow.band] else 0.0
    if not any(depth):
        admitting.queue_emptied()
    admitting.settled(flow.band, flow.tenant, expired=True)
    return flow


def displace_overdue(
    band: int,
    now: float,
    known: list[dict[str, Flow]],
    waiting: dict[int, Entry],
    gone: set[int],
    depth: list[int],
    work: list[float],
    vtime: list[float],
    admitting: Admitting,
) -> int:
    """The memory store's displacement (ModelQueue.displace_overdue, policies.displacement) after
    an arrival queued in `band`: the newest OVERDUE_CHECKED requests of each flow of a less urgent
    band that can no longer get a slot by their leave-by time leave at once. Returns how many."""
    throughput = admitting.throughput(now)
    handovers_per_s = displacement_handovers_per_s(throughput)
    victims: list[int] = []
    for lower in range(band + 1, len(depth)):
        if not depth[lower]:
            continue
        urgent = sum(depth[:lower])
        for flow in known[lower].values():
            newest = list(itertools.islice(reversed(flow.live.items()), OVERDUE_CHECKED))
            found = overdue_in_flow(
                now,
                urgent,
                len(flow.live),
                ((leave_by, 1) for _, leave_by in newest),
                handovers_per_s,
                throughput.service_cv,
                in_arrival_order=True,  # fair queuing serves a flow in its arrival order
            )
            victims += (newest[i][0] for i in found)
    for seq in victims:
        flow = leave_queue(seq, waiting, gone, depth, work, vtime, admitting)
        if waiting.pop(seq)[6]:
            flow.tally.displaced += 1
    return len(victims)
