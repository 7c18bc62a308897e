"""The pieces of a streamed OpenAI answer (``"stream": true``): the events of a program carried from the scheduler's
thread to the response's event loop, the answer's text turned into content deltas that never take back what was
sent, and the chunks in OpenAI's format.

Imports nothing of fastgate; :meth:`fastgate.entrypoints.http.openai.OpenAIServing.stream` puts them together.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import Future
from typing import Any

from fastgate.entrypoints.http.common import DISCONNECT_POLL_S

__all__ = ["POLL_S", "AnswerStream", "Events", "chunk", "stable_text"]

log = logging.getLogger(__name__)

POLL_S = DISCONNECT_POLL_S  # while no event comes, a stream checks this often whether its client has gone


def stable_text(text: str, stop: list[str] | tuple[str, ...]) -> str:
    """The part of a generation's text so far that no later token can change: without a trailing incomplete UTF-8
    character (decoded as U+FFFD until its last byte comes) and without a tail that may be the start of a stop string
    (the decode loop cuts the text there once the stop string is complete)."""
    text = text.rstrip("\ufffd")
    hold = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return text[:len(text) - hold]


class AnswerStream:
    """Turns snapshots of the answer generation's text into content deltas whose concatenation is the answer (the
    methods answer ``text.strip()``): leading whitespace is dropped and trailing whitespace held back until more text
    follows it. Text once sent cannot be taken back, so if a snapshot does not extend what was sent (a tokenizer whose
    decoding of a longer sequence rewrites earlier text), streaming stops and :meth:`finish` sends the rest."""

    def __init__(self) -> None:
        self.sent = ""
        self.broken = False

    def update(self, text: str, stop: list[str], done: bool) -> str:
        """The new content of snapshot ``text`` (``done``: the generation's final text)."""
        if self.broken:
            return ""
        stable = text.strip() if done else stable_text(text, stop).strip()
        if not stable.startswith(self.sent):
            self.broken = True
            return ""
        delta, self.sent = stable[len(self.sent):], stable
        return delta

    def finish(self, answer: str) -> str:
        """What is left to send of the final ``answer``."""
        if answer.startswith(self.sent):
            delta, self.sent = answer[len(self.sent):], answer
            return delta
        log.warning("streamed text %r is not a prefix of the answer %r; the record has the answer", self.sent, answer)
        return ""


class Events:
    """A program's progress events, from the scheduler's thread to the event loop that streams them: pass
    :meth:`listener` to the submission, then :meth:`follow` its future; :meth:`get` gives the events, then
    :attr:`END` once the program ended."""

    END = object()

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def listener(self, event: dict) -> None:
        """On the scheduler's thread."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    def follow(self, future: Future) -> None:
        """:attr:`END` comes once ``future`` is done."""

        def ended(_f: Future) -> None:
            try:
                self.loop.call_soon_threadsafe(self.queue.put_nowait, self.END)
            except RuntimeError:  # the event loop has closed (server shutdown)
                pass

        future.add_done_callback(ended)

    async def get(self, timeout_s: float) -> Any:
        """The next event (or :attr:`END`); ``asyncio.TimeoutError`` when none comes within ``timeout_s``."""
        return await asyncio.wait_for(self.queue.get(), timeout_s)


def chunk(chat: bool, rid: str, created: int, model: str, content: str | None = None, finish: str | None = None,
          ext: dict | None = None, role: bool = False) -> dict[str, Any]:
    """One chunk of a streamed chat completion (``chat``) or completion: a content delta, the finish reason, the
    ``fastgate`` extension (an event, or the record at the end), or (chat, first) the assistant's role."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
        if content is not None:
            delta["content"] = content
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": content or "", "logprobs": None, "finish_reason": finish}
    out = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
           "model": model, "choices": [choice]}
    if ext is not None:
        out["fastgate"] = ext
    return out
