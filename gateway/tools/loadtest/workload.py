"""What a load test sends: a mix of traffic (class x tenant x kind x size) and the arrival times.

Arrivals are open-loop: their times are drawn before the run and never wait on answers, so a slow
target cannot slow the load down and hide its own queueing. Inter-arrival gaps are exponential
(Poisson) or gamma-distributed with a chosen coefficient of variation (`burstiness`: above 1,
arrivals come in bursts; 1 is Poisson). The same seed gives the same arrivals for every target.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

KINDS = ("infer", "chat", "completion", "grpc")
"""KServe v2 infer over HTTP, OpenAI chat and completions, and KServe v2 `ModelInfer` over gRPC."""


class ScenarioError(ValueError):
    """A scenario that cannot be run; the message names the field."""


@dataclass(frozen=True, slots=True)
class Traffic:
    """One stream of requests in the mix: who sends what, how often and with which deadline."""

    name: str
    share: float = 1.0
    """Its part of the run's rate (shares are normalized over the entries that have no `rate`)."""
    rate: float | None = None
    """Requests per second of its own, whatever the run's rate; None: a share of it."""
    kind: str = "infer"
    stream: bool = False
    priority: str | None = None
    """Sent as X-Priority; None: the gateway's default class."""
    tenant: str | None = None
    """Sent as X-Tenant (where the gateway reads it); reports group by it."""
    api_key: str | None = None
    """Sent as `Authorization: Bearer`; reports group by `tenant`, never by the key."""
    weight: float = 1.0
    """The tenant's weight in the gateway's config: what its fair share of goodput is judged by."""
    deadline_ms: float = 1000.0
    """Sent as X-Request-Timeout-Ms; an answer later than this (from the scheduled send) is not good."""
    size: int = 4
    """infer and grpc: elements of the FP32 input tensor; chat and completion: max_tokens."""
    prompt_words: int = 16
    """chat and completion: the prompt's length in words."""
    body: Mapping[str, Any] | None = None
    """The JSON body as it is (the model's own tensors), instead of the generated one."""
    headers: Mapping[str, str] = field(default_factory=dict)

    @property
    def group(self) -> str:
        """The class a report files it under: its priority, or `default`."""
        return self.priority or "default"

    @property
    def tenant_label(self) -> str:
        return self.tenant or "default"


@dataclass(frozen=True, slots=True)
class Scenario:
    traffic: tuple[Traffic, ...]
    burstiness: float = 1.0
    """The coefficient of variation of inter-arrival gaps: 1 Poisson, above 1 bursty."""

    def rates(self, rate: float) -> list[float]:
        """Each entry's arrival rate when the run offers `rate` requests per second to the shares."""
        shared = sum(t.share for t in self.traffic if t.rate is None)
        return [t.rate if t.rate is not None else rate * t.share / shared for t in self.traffic]


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    """Its scheduled send, in seconds from the run's start."""
    traffic: int
    """Its entry in the scenario's traffic."""


def arrivals(scenario: Scenario, rate: float, duration_s: float, seed: int = 1) -> list[Arrival]:
    """Every entry's arrivals over `duration_s`, merged in time order: each entry is a renewal
    process of its own (Poisson, or gamma gaps), so a share's rate holds whatever the others do."""
    rng = random.Random(seed)
    merged: list[Arrival] = []
    cv = scenario.burstiness
    for index, entry_rate in enumerate(scenario.rates(rate)):
        if entry_rate <= 0:
            continue
        # Gamma gaps with mean 1/rate and coefficient of variation cv: shape 1/cv², scale cv²/rate.
        shape = 1.0 / (cv * cv)
        scale = cv * cv / entry_rate
        now = 0.0
        while True:
            now += rng.expovariate(entry_rate) if cv == 1.0 else rng.gammavariate(shape, scale)
            if now >= duration_s:
                break
            merged.append(Arrival(now, index))
    merged.sort(key=lambda a: a.at_s)
    return merged


def load_scenario(path: Path) -> Scenario:
    """The scenario a YAML file describes (see docs: `traffic:` a list of entries, `burstiness:`)."""
    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise ScenarioError(f"{path}: {error}") from None
    return scenario_from(document, str(path))


def scenario_from(document: Any, where: str = "scenario") -> Scenario:
    if not isinstance(document, dict) or not isinstance(document.get("traffic"), list):
        raise ScenarioError(f"{where}: needs `traffic:`, a list of entries")
    unknown = set(document) - {"traffic", "burstiness"}
    if unknown:
        raise ScenarioError(f"{where}: unknown field(s) {sorted(unknown)}")
    entries = tuple(_traffic(entry, f"{where}: traffic[{i}]") for i, entry in enumerate(document["traffic"]))
    if not entries:
        raise ScenarioError(f"{where}: `traffic:` is empty")
    names = [t.name for t in entries]
    if len(set(names)) != len(names):
        raise ScenarioError(f"{where}: traffic names repeat: {names}")
    burstiness = _number(document.get("burstiness", 1.0), f"{where}: burstiness", low=0.05)
    return Scenario(entries, burstiness)


_FIELDS = set(Traffic.__dataclass_fields__)


def _traffic(entry: Any, where: str) -> Traffic:
    if not isinstance(entry, dict):
        raise ScenarioError(f"{where}: must be a mapping")
    unknown = set(entry) - _FIELDS
    if unknown:
        raise ScenarioError(f"{where}: unknown field(s) {sorted(unknown)}")
    values = dict(entry)
    values.setdefault("name", f"traffic-{where.rsplit('[', 1)[-1].rstrip(']')}")
    if values.get("kind", "infer") not in KINDS:
        raise ScenarioError(f"{where}: kind must be one of {', '.join(KINDS)}")
    for name, low in (("share", 0.0), ("weight", 0.0), ("deadline_ms", 1.0)):
        if name in values:
            values[name] = _number(values[name], f"{where}: {name}", low=low)
    if values.get("rate") is not None:
        values["rate"] = _number(values["rate"], f"{where}: rate", low=0.0)
    for name in ("size", "prompt_words"):
        if name in values and (not isinstance(values[name], int) or values[name] < 1):
            raise ScenarioError(f"{where}: {name} must be a whole number >= 1")
    if "headers" in values and not (
        isinstance(values["headers"], dict) and all(isinstance(v, str) for v in values["headers"].values())
    ):
        raise ScenarioError(f"{where}: headers must map names to strings")
    if values.get("body") is not None and not isinstance(values["body"], dict):
        raise ScenarioError(f"{where}: body must be a JSON object")
    for name in ("name", "priority", "tenant", "api_key"):
        if values.get(name) is not None and not isinstance(values[name], str):
            raise ScenarioError(f"{where}: {name} must be a string")
    if "stream" in values and not isinstance(values["stream"], bool):
        raise ScenarioError(f"{where}: stream must be true or false")
    if values.get("stream") and values.get("kind", "infer") == "infer":
        raise ScenarioError(f"{where}: stream needs kind chat or completion")
    return Traffic(**values)


def _number(value: Any, where: str, low: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < low:
        raise ScenarioError(f"{where}: must be a number >= {low:g}")
    return float(value)


def read_body(path: Path) -> dict[str, Any]:
    """A request body from a JSON file (`--body`)."""
    try:
        body = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ScenarioError(f"{path}: {error}") from None
    if not isinstance(body, dict):
        raise ScenarioError(f"{path}: must hold a JSON object")
    return body


def total_rate(scenario: Scenario, rate: float) -> float:
    return sum(scenario.rates(rate))


def one_traffic(**fields: Any) -> Scenario:
    """The scenario of a run given by flags alone: one entry."""
    return Scenario((_traffic({k: v for k, v in fields.items() if v is not None}, "flags"),))
