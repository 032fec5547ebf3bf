"""What a generation request will cost in tokens: estimated at its arrival, learned from the usage
the engine returns.

Rules this module keeps:
- A request costs `prompt_weight` x its prompt tokens + its output tokens. A prompt token is cheaper
  than a generated one (it is prefilled in parallel with the rest of its prompt); VTC (OSDI'24)
  weighs them 1 : 2, hence the default of 0.5.
- Prompt tokens are estimated from the prompt's characters, without a tokenizer: a fixed overhead
  (the chat template's tokens around the messages) + characters / chars_per_token, fitted to the
  model's last `window` answers by a robust line (the median of the slopes between the shorter
  and the longer half of the prompts, Theil-Sen's on those pairs, and the median of what is left
  over it). A ratio alone, learned from short chats whose template tokens outnumber their text's,
  priced a long prompt many times over. Prompts all of one length fit no line: the median of
  their ratios, no overhead. Until `min_samples` answers came it is PRIOR_CHARS_PER_TOKEN, OpenAI's
  rule of thumb for English, so that costs are in tokens from the first request (a cost of 1 that
  turns into hundreds would change the unit of every queue, quota and rate mid-flight).
- Output tokens are the smaller of the request's `max_tokens` and the `output_quantile` of the
  completion lengths of the tenant's last `window` answers on this model (of the model's, while
  the tenant has fewer than `min_samples`). With no answers yet: `max_tokens`, or
  `default_output_tokens` when the request sets none. A request that asks for several completions
  (`n`, `best_of`, a list of prompts) costs that many; lengths are learned per completion.
- Medians and quantiles over a window are robust: one huge answer moves them by one rank, not by
  its size. A ratio or length that is not positive and finite is not learned.
- The model's error is the median, over its last `window` answers, of |estimated - actual| /
  actual cost: what `gateway_cost_model_error` reports.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import median

PRIOR_CHARS_PER_TOKEN = 4.0


@dataclass(frozen=True, slots=True)
class TokenPricing:
    prompt_weight: float = 0.5
    output_quantile: float = 0.9
    default_output_tokens: int = 256
    window: int = 256
    min_samples: int = 8


@dataclass(frozen=True, slots=True)
class CostEstimate:
    prompt_tokens: float
    output_tokens: float
    cost: float


class _Window:
    """The last `size` values, with their order statistics computed once per change."""

    __slots__ = ("_sorted", "values")

    def __init__(self, size: int) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self._sorted: list[float] | None = None

    def add(self, value: float) -> None:
        self.values.append(value)
        self._sorted = None

    def __len__(self) -> int:
        return len(self.values)

    def quantile(self, q: float) -> float:
        if self._sorted is None:
            self._sorted = sorted(self.values)
        ranked = self._sorted
        return ranked[min(len(ranked) - 1, max(0, math.ceil(q * len(ranked)) - 1))]


class _PromptFit:
    """tokens = overhead + chars / chars_per_token over the last `size` (chars, tokens) answers."""

    __slots__ = ("_fitted", "pairs")

    def __init__(self, size: int) -> None:
        self.pairs: deque[tuple[float, float]] = deque(maxlen=size)
        self._fitted: tuple[float, float] | None = None

    def add(self, chars: float, tokens: float) -> None:
        self.pairs.append((chars, tokens))
        self._fitted = None

    def __len__(self) -> int:
        return len(self.pairs)

    def line(self) -> tuple[float, float]:
        """(overhead tokens, tokens per char)."""
        if self._fitted is None:
            self._fitted = _robust_line(sorted(self.pairs))
        return self._fitted


def _robust_line(pairs: list[tuple[float, float]]) -> tuple[float, float]:
    half = len(pairs) // 2
    slopes = [
        (long_t - short_t) / (long_c - short_c)
        for (short_c, short_t), (long_c, long_t) in zip(pairs[:half], pairs[half : 2 * half], strict=True)
        if long_c > short_c
    ]
    slope = median(slopes) if len(slopes) >= max(1, half // 2) else 0.0
    if not slope > 0:  # one length (or noise that slopes down): a ratio, no overhead
        return 0.0, median([t / c for c, t in pairs])
    return max(0.0, median([t - slope * c for c, t in pairs])), slope


class TokenCostModel:
    """One model's cost estimates, learned online; tenants are configured names (a closed set)."""

    def __init__(self, pricing: TokenPricing = TokenPricing()) -> None:
        self.pricing = pricing
        self._prompts = _PromptFit(pricing.window)
        self._outputs: dict[str, _Window] = {}
        self._all_outputs = _Window(pricing.window)
        self._errors = _Window(pricing.window)

    @property
    def chars_per_token(self) -> float:
        return 1.0 / self._prompt_line()[1]

    @property
    def prompt_overhead(self) -> float:
        """The tokens a prompt has beyond its text's (the chat template's), as fitted."""
        return self._prompt_line()[0]

    def _prompt_line(self) -> tuple[float, float]:
        if len(self._prompts) < max(1, self.pricing.min_samples):
            return 0.0, 1.0 / PRIOR_CHARS_PER_TOKEN
        return self._prompts.line()

    def expected_output_tokens(self, max_tokens: int | None, tenant: str = "") -> float:
        pricing = self.pricing
        lengths = self._outputs.get(tenant)
        if lengths is None or len(lengths) < pricing.min_samples:
            lengths = self._all_outputs
        if len(lengths) < pricing.min_samples:
            return float(max_tokens if max_tokens is not None else pricing.default_output_tokens)
        learned = lengths.quantile(pricing.output_quantile)
        return learned if max_tokens is None else min(float(max_tokens), learned)

    def estimate(
        self, prompt_chars: int, max_tokens: int | None, tenant: str = "", choices: int = 1
    ) -> CostEstimate:
        """The cost of a request whose prompt has `prompt_chars` characters and that asks for
        `choices` completions (each up to `max_tokens`)."""
        overhead, per_char = self._prompt_line()
        prompt = max(1.0, overhead + prompt_chars * per_char)
        output = max(1, choices) * max(1.0, self.expected_output_tokens(max_tokens, tenant))
        return CostEstimate(prompt, output, self.pricing.prompt_weight * prompt + output)

    def learn(
        self,
        prompt_chars: int,
        estimate: CostEstimate,
        prompt_tokens: float,
        completion_tokens: float,
        tenant: str = "",
        choices: int = 1,
    ) -> None:
        """An answer's `usage`: the true counts of a request estimated as `estimate`, which asked for
        `choices` completions (the lengths learned are each one's)."""
        if _usable(prompt_tokens) and prompt_chars > 0:
            self._prompts.add(prompt_chars, prompt_tokens)
        if _usable(completion_tokens):
            each = completion_tokens / max(1, choices)
            self._outputs.setdefault(tenant, _Window(self.pricing.window)).add(each)
            self._all_outputs.add(each)
        if _usable(prompt_tokens) and _usable(completion_tokens):
            actual = self.pricing.prompt_weight * prompt_tokens + completion_tokens
            self._errors.add(abs(estimate.cost - actual) / actual)

    @property
    def error(self) -> float | None:
        """The median relative error of the recent estimates; None before any answer."""
        return self._errors.quantile(0.5) if len(self._errors) else None


def _usable(count: float) -> bool:
    return math.isfinite(count) and count > 0
