"""OpenAI chat and completions on the continuous-batching engine, answered as vLLM answers them.

The output is as long as the request's `max_tokens` with `ignore_eos`, else where the model stops
of itself (gateway.tools.model_server.tokens), at most `max_tokens`. Answers carry `usage`; a
stream carries it in a last chunk with no choices when `stream_options.include_usage` is set, and
`"usage": null` on the chunks before it. A request whose client leaves is aborted at once, waiting or running.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.types import Receive, Send

from gateway.http.asgi_io import until_disconnect
from gateway.http.pricing import max_tokens_of
from gateway.tools.model_server.continuous import ContinuousEngine, Sequence
from gateway.tools.model_server.replies import end_events, reply_json, send_event, start_events
from gateway.tools.model_server.tokens import natural_output_tokens, prompt_text, prompt_tokens

MAX_OUTPUT_TOKENS = 8192


class ContinuousChat:
    def __init__(self, engine: ContinuousEngine, *, default_tokens: int) -> None:
        self.engine = engine
        self.default_tokens = default_tokens

    async def serve(
        self, request: dict[str, Any], ident: str, receive: Receive, send: Send, *, chat: bool
    ) -> None:
        model = str(request["model"])
        prompt = prompt_tokens(request, chat=chat)
        output, finish_reason = self.output_tokens(request, chat=chat)
        priority = request.get("priority", 0)
        if not isinstance(priority, int) or isinstance(priority, bool):
            await reply_json(send, 400, {"error": {"message": "'priority' must be an integer"}})
            return
        sequence = self.engine.start(model, prompt, output, priority=priority)
        watch = asyncio.ensure_future(self._abort_when_gone(receive, sequence))
        try:
            if request.get("stream") is True:
                options = request.get("stream_options") or {}
                usage = isinstance(options, dict) and options.get("include_usage") is True
                await self._stream(
                    send, sequence, ident, model, finish_reason, chat=chat, include_usage=usage
                )
                return
            while not sequence.ended:
                await self.engine.progress(sequence)
            if not sequence.finished:
                return  # aborted: its client is gone
            await reply_json(send, 200, _completion(sequence, ident, model, finish_reason, chat=chat))
        finally:
            watch.cancel()
            self.engine.abort(sequence)  # a no-op once it ended

    def output_tokens(self, request: dict[str, Any], *, chat: bool) -> tuple[int, str]:
        """How many tokens it will make, and its finish_reason: `stop` where the model ends of itself."""
        cap = min(max_tokens_of(request) or MAX_OUTPUT_TOKENS, MAX_OUTPUT_TOKENS)
        if request.get("ignore_eos") is True:
            return cap, "length"
        natural = natural_output_tokens(prompt_text(request, chat=chat), self.default_tokens)
        return (natural, "stop") if natural < cap else (cap, "length")

    async def _abort_when_gone(self, receive: Receive, sequence: Sequence) -> None:
        await until_disconnect(receive)
        self.engine.abort(sequence)

    async def _stream(
        self,
        send: Send,
        sequence: Sequence,
        ident: str,
        model: str,
        finish_reason: str,
        *,
        chat: bool,
        include_usage: bool,
    ) -> None:
        created = int(time.time())
        started = False
        sent = 0
        while True:
            made = await self.engine.progress(sequence)
            if sequence.ended and not sequence.finished:
                return  # aborted
            if not started:
                await start_events(send)
                started = True
            for index in range(sent, made):
                last = index == sequence.output_tokens - 1
                piece = f"tok{index}" + ("" if last else " ")
                choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason if last else None}
                choice["delta" if chat else "text"] = {"content": piece} if chat else piece
                chunk = _chunk(ident, model, created, [choice], chat=chat)
                if include_usage:
                    chunk["usage"] = None
                await send_event(send, chunk)
            sent = made
            if sequence.finished:
                break
        if include_usage:
            chunk = _chunk(ident, model, created, [], chat=chat)
            chunk["usage"] = _usage(sequence)
            await send_event(send, chunk)
        await end_events(send)


def _usage(sequence: Sequence) -> dict[str, int]:
    return {
        "prompt_tokens": sequence.prompt_tokens,
        "completion_tokens": sequence.generated,
        "total_tokens": sequence.prompt_tokens + sequence.generated,
    }


def _chunk(ident: str, model: str, created: int, choices: list[Any], *, chat: bool) -> dict[str, Any]:
    return {
        "id": ident,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
    }


def _completion(
    sequence: Sequence, ident: str, model: str, finish_reason: str, *, chat: bool
) -> dict[str, Any]:
    text = " ".join(f"tok{i}" for i in range(sequence.generated))
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": ident,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
        "usage": _usage(sequence),
    }
