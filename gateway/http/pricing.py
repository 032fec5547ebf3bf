"""What a request costs in work units, where a model prices by batch items or by tokens.

KServe v2 inference requests cost their batch size; OpenAI generation requests their estimated
tokens (policies.token_costs), learned from the `usage` their answers carry.

A request's batch is dimension 0 of its first input's shape (KServe v2 puts the batch first on every
input of a batching model). For a binary-tensor body only its JSON header is read (its length is
the `Inference-Header-Content-Length` field); a JSON body is parsed whole, which costs CPU in
proportion to its size: a model whose requests are large JSON tensors may rather be priced by
request. A body whose batch cannot be read costs 1: pricing never refuses a request, the backend
judges its body.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from gateway.tensors.batch import header_length_of
from policies.token_costs import CostEstimate, TokenCostModel


def batch_items(body: bytes, headers: Iterable[tuple[bytes, bytes]]) -> float:
    """The request's batch size, or 1 where it cannot be read."""
    length = header_length_of(headers)
    if length is not None and not 0 <= length <= len(body):
        return 1.0
    try:
        request = json.loads(body if length is None else body[:length])
        first = request["inputs"][0]["shape"][0]
    except (ValueError, KeyError, IndexError, TypeError, RecursionError):
        return 1.0
    if isinstance(first, bool) or not isinstance(first, int) or first < 1:
        return 1.0
    return float(first)


def request_parameter(body: bytes, headers: Iterable[tuple[bytes, bytes]], name: str) -> object:
    """A KServe v2 request's `parameters[name]` (JSON, or a binary body's JSON header), or None
    where it has none or cannot be read (the backend judges such a body)."""
    return request_parameters(body, headers).get(name)


def json_part(body: bytes, headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """The JSON of a KServe v2 request: the whole body, or a binary one's header (its tensors'
    bytes, megabytes of them, never scanned for a parameter)."""
    length = header_length_of(headers)
    return body if length is None or not 0 <= length <= len(body) else body[:length]


def request_parameters(body: bytes, headers: Iterable[tuple[bytes, bytes]]) -> dict[str, object]:
    """A KServe v2 request's `parameters`, {} where it has none or they cannot be read."""
    length = header_length_of(headers)
    if length is not None and not 0 <= length <= len(body):
        return {}
    try:
        parameters = json.loads(body if length is None else body[:length]).get("parameters")
    except (ValueError, AttributeError, RecursionError):
        return {}
    return parameters if isinstance(parameters, dict) else {}


def prompt_chars(payload: dict[str, Any]) -> int:
    """The characters of an OpenAI request's prompt: its messages' text and the tools it offers
    (their schemas are prompt too, often thousands of tokens), or its `prompt` (token ids count 4
    each, the prior's ratio), or its embedding `input`."""
    messages = payload.get("messages")
    if isinstance(messages, list):
        text = sum(_text_chars(m.get("content")) for m in messages if isinstance(m, dict))
        return text + sum(_json_chars(payload.get(field)) for field in ("tools", "functions"))
    prompt = payload.get("prompt", payload.get("input"))
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return 4 * len(prompt)
    return _text_chars(prompt)


def _text_chars(content: Any) -> int:
    """A string's characters, or a list's: content parts, or a batch of prompts (strings, or token
    ids at 4 each). Nothing deeper counts: a body nested hundreds deep must not exhaust the stack."""
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        return 0
    chars = 0
    for part in content:
        text = part.get("text") if isinstance(part, dict) else part
        if isinstance(text, str):
            chars += len(text)
        elif isinstance(text, list) and all(isinstance(t, int) for t in text):
            chars += 4 * len(text)
    return chars


def _json_chars(value: Any) -> int:
    if value is None:
        return 0
    try:
        return len(json.dumps(value))
    except (ValueError, TypeError, RecursionError):  # nested too deep to count: counted as nothing
        return 0


def choices_of(payload: dict[str, Any]) -> int:
    """The completions a request asks for: `n` (or `best_of`, which the engine generates and
    ranks) for each of its prompts (a list of prompts is a batch)."""
    each = max(_count(payload.get("n")) or 1, _count(payload.get("best_of")) or 1)
    prompt = payload.get("prompt")
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return each * len(prompt)
    return each


def _count(value: Any) -> int | None:
    """A JSON field that counts something (a positive integer, not a boolean), or None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def max_tokens_of(payload: dict[str, Any]) -> int | None:
    for field in ("max_completion_tokens", "max_tokens"):
        if (count := _count(payload.get(field))) is not None:
            return count
    return None


class UsageLearner:
    """Feeds one answer's `usage` back into its model's cost model (a Relay's `observe`)."""

    __slots__ = ("_chars", "_choices", "_estimate", "_model", "_on_error", "_tenant")

    def __init__(
        self,
        model: TokenCostModel,
        chars: int,
        estimate: CostEstimate,
        tenant: str,
        on_error: Callable[[float], None],
        choices: int = 1,
    ) -> None:
        self._model = model
        self._chars = chars
        self._estimate = estimate
        self._tenant = tenant
        self._choices = choices
        self._on_error = on_error

    def __call__(self, answer: bytes) -> None:
        usage = usage_in(answer)
        if usage is None:
            return
        self._model.learn(self._chars, self._estimate, *usage, self._tenant, self._choices)
        if (error := self._model.error) is not None:
            self._on_error(error)


_DATA_FIELD = re.compile(rb"(?:^|[\r\n])data:")
_LINE_END = re.compile(rb"[\r\n]")


def usage_in(answer: bytes) -> tuple[float, float] | None:
    """(prompt_tokens, completion_tokens) from an OpenAI answer, or from the tail of its event
    stream (the last event that carries usage); None where it carries none."""
    at = answer.rfind(b'"usage"')
    if at < 0:
        return None
    # An event's data field starts a line; "data:" anywhere else is the text of a JSON answer.
    fields = list(_DATA_FIELD.finditer(answer, 0, at))
    if not fields:
        document = answer  # a whole JSON answer
    else:
        end = _LINE_END.search(answer, at)
        document = answer[fields[-1].end() : end.start() if end else len(answer)]
    try:
        usage = json.loads(document)["usage"]
        return float(usage["prompt_tokens"]), float(usage["completion_tokens"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError, RecursionError):
        return None
