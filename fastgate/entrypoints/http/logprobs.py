"""Token log-probabilities in OpenAI's formats: ``choices[i].logprobs`` of a completion (``tokens``,
``token_logprobs``, ``top_logprobs``, ``text_offset``) and of a chat completion (``content``: token, logprob, bytes,
top_logprobs), from the tokens' bytes and log-probabilities a :class:`~fastgate.serving.completion.Completion` or
``fastgate-never``'s answer carries.

Imports nothing of fastgate; :mod:`fastgate.entrypoints.http.openai` and :mod:`fastgate.entrypoints.http.plain` call it.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence
from typing import Any

__all__ = ["chat_logprobs", "completion_logprobs", "openai_token"]


def openai_token(piece: bytes) -> str:
    """A token as OpenAI's APIs write it: its text, or ``bytes:\\xNN...`` when it is not whole UTF-8."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in piece)


def completion_logprobs(pieces: Sequence[bytes], logprobs: Sequence[float],
                        top: Sequence[Sequence[tuple[bytes, float]]] | None, *, stripped: bool = False
                        ) -> dict[str, Any]:
    """``choices[i].logprobs`` of a completion: ``tokens``, ``token_logprobs``, ``top_logprobs`` (one ``{token:
    log-prob}`` per token, or None when none were asked for) and ``text_offset`` (characters into the text);
    ``stripped``: the text is the tokens' with its leading whitespace removed (a method's answer, " Paris" -> "Paris"),
    so the offsets count from its first character and a token inside that whitespace is at 0."""
    tokens = [openai_token(p) for p in pieces]
    # a token's offset: the characters its predecessors' bytes decode to, as the text was decoded (invalid bytes one
    # U+FFFD each; a character split across tokens counted where it is complete)
    decoder, offsets, pos = codecs.getincrementaldecoder("utf-8")("replace"), [], 0
    for p in pieces:
        offsets.append(pos)
        pos += len(decoder.decode(p))
    if stripped:
        text = b"".join(pieces).decode("utf-8", "replace")
        lead = len(text) - len(text.lstrip())
        offsets = [max(o - lead, 0) for o in offsets]
    tops = None
    if top is not None:
        tops = [{openai_token(p): float(lp) for p, lp in step} for step in top]
    return {"tokens": tokens, "token_logprobs": [float(x) for x in logprobs], "top_logprobs": tops,
            "text_offset": offsets}


def chat_logprobs(pieces: Sequence[bytes], logprobs: Sequence[float],
                  top: Sequence[Sequence[tuple[bytes, float]]] | None) -> dict[str, Any]:
    """``choices[i].logprobs`` of a chat completion: ``{"content": [{"token", "logprob", "bytes",
    "top_logprobs"}]}``."""
    content = []
    for i, (p, lp) in enumerate(zip(pieces, logprobs)):
        alts = [{"token": openai_token(q), "logprob": float(v), "bytes": list(q)} for q, v in top[i]] if top else []
        content.append({"token": openai_token(p), "logprob": float(lp), "bytes": list(p), "top_logprobs": alts})
    return {"content": content, "refusal": None}
