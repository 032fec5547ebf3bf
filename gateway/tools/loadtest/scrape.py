"""Metrics read during a run: the gateway's queues and slots, and an engine's own counts, once a second.

Only gauges a report plots are kept, summed by the labels that matter to it, so a long run stays
small. A scrape that fails is recorded as failed (an absent reading is not a zero).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

KEPT: Mapping[str, tuple[str, ...]] = {
    # family: the labels its samples are summed by
    "gateway_queue_depth": ("priority",),
    "gateway_inflight_requests": (),
    "gateway_backend_slots": ("backend",),
    "gateway_backend_queue": (),
    "vllm:num_requests_running": (),
    "vllm:num_requests_waiting": (),
    "nv_inference_pending_request_count": (),
}


@dataclass(slots=True)
class Scrape:
    t_s: float
    source: str
    ok: bool
    values: dict[str, float] = field(default_factory=dict)
    """`family` or `family{label=value}` -> the sum of its samples."""


def readings(text: str) -> dict[str, float]:
    """The kept families of an exposition, summed by their labels of interest."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        labels_kept = KEPT.get(family.name)
        if labels_kept is None:
            continue
        for sample in family.samples:
            if sample.name != family.name:
                continue
            key = family.name
            if labels_kept:
                parts = ",".join(f"{label}={sample.labels.get(label, '')}" for label in labels_kept)
                key = f"{family.name}{{{parts}}}"
            values[key] = values.get(key, 0.0) + sample.value
    return values


async def scrape_until(
    sources: Mapping[str, str], started: float, stop: asyncio.Event, into: list[Scrape], every_s: float = 1.0
) -> None:
    """Scrape each `sources` name -> /metrics URL every `every_s` until `stop` is set."""
    timeout = aiohttp.ClientTimeout(total=max(0.5, every_s))
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while not stop.is_set():
            for source, url in sources.items():
                t_s = time.monotonic() - started
                try:
                    async with session.get(url) as reply:
                        text = await reply.text() if reply.status == 200 else None
                    scrape = Scrape(t_s, source, text is not None, readings(text) if text else {})
                except (aiohttp.ClientError, TimeoutError, ValueError):
                    scrape = Scrape(t_s, source, False)
                into.append(scrape)
            try:
                await asyncio.wait_for(stop.wait(), every_s)
            except TimeoutError:
                pass
