"""Labelled hidden-state features for the learned gates, cached on disk so an interrupted run resumes.

The cache is a directory of chunk files (``chunk_00000.safetensors`` …, each written atomically) holding features,
labels and the example ids they came from, plus ``meta.json`` naming what was extracted (model fingerprint, kind,
layers). Re-running skips every example already in a chunk; a cache made for other settings is refused.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from fastgate.config import GenerationConfig, TapSpec
from fastgate.engine.local import Engine
from fastgate.errors import CheckpointError
from fastgate.eval.datasets import QAExample
from fastgate.eval.metrics import accuracy
from fastgate.prompts import ANSWER_STOP, closed_book_prompt, cot_prompt, extract_answer

__all__ = ["FeatureCache", "confidence_features", "prober_features"]


class FeatureCache:
    """Append-only, resumable feature store.

    Args:
        root: cache directory (created).
        meta: what the features are; must equal the ``meta.json`` of an existing cache.
    """

    def __init__(self, root: str | Path, meta: dict[str, Any]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        meta_path = self.root / "meta.json"
        if meta_path.exists():
            try:
                old = json.loads(meta_path.read_text())
            except (OSError, ValueError) as exc:
                raise CheckpointError(f"the feature cache's {meta_path} is unreadable ({exc}): delete {self.root} "
                                      "(its features are computed again) or use another --cache") from None
            if old != meta:
                raise CheckpointError(f"the feature cache {self.root} was made for {old}, not {meta}; use another "
                                      "--cache directory or delete it")
        else:  # whole or absent: a process killed while writing it left an empty file that failed every later run
            tmp = meta_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(meta, indent=2) + "\n")
            os.replace(tmp, meta_path)
        self.meta = meta
        self._chunks = sorted(self.root.glob("chunk_*.safetensors"))
        self.done: set[str] = set()  # example ids whose rows are in a chunk
        self.keys: dict[str, str] = {}  # example id -> example_key of what its rows were computed from
        for path in self._chunks:
            done = self._meta(path, "examples")
            self.done.update(done)
            keys = self._meta(path, "keys", optional=True)  # chunks from before keys were kept have none
            if keys is not None and len(keys) == len(done):
                self.keys.update(zip(done, keys))

    def check(self, examples: Sequence[QAExample]) -> None:
        """Refuse examples whose question or gold answers differ from those their cached rows were computed from (a
        ``--data`` file edited since: its ids are line numbers, so the old rows and labels were silently reused).

        Raises:
            CheckpointError: naming the first such example."""
        for e in examples:
            was = self.keys.get(e.id)
            if was is not None and was != example_key(e):
                raise CheckpointError(f"the feature cache {self.root} computed example {e.id} from another question "
                                      f"or other gold answers than {e.question!r:.80} now has (the data changed "
                                      "since): delete the cache or use another --cache")

    @staticmethod
    def _meta(path: Path, key: str, optional: bool = False) -> list[str] | None:
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "pt") as f:
                meta = f.metadata()
                if optional and key not in meta:
                    return None
                return json.loads(meta[key])
        except (SafetensorError, OSError, ValueError, KeyError, TypeError) as exc:
            raise _corrupt_chunk(path, exc) from None

    def add(self, ids: Sequence[str], features: torch.Tensor, labels: torch.Tensor,
            examples: Sequence[QAExample]) -> None:
        """Write one chunk: ``features [n, ...]``, ``labels [n]`` for rows ``ids``, finishing ``examples`` (their
        :func:`example_key` s kept for :meth:`check`)."""
        from safetensors.torch import save_file

        done, keys = [e.id for e in examples], [example_key(e) for e in examples]
        meta = {"ids": json.dumps(list(ids)), "examples": json.dumps(done), "keys": json.dumps(keys)}
        path = self.root / f"chunk_{len(self._chunks):05d}.safetensors"
        tmp = path.with_suffix(".tmp")
        save_file({"features": features.detach().cpu().float().contiguous(),
                   "labels": labels.detach().cpu().long().contiguous()}, str(tmp), metadata=meta)
        os.replace(tmp, path)  # a chunk exists whole or not at all
        self._chunks.append(path)
        self.done.update(done)
        self.keys.update(zip(done, keys))

    def finished(self, example_id: str) -> bool:
        return example_id in self.done

    def load(self) -> tuple[list[str], torch.Tensor, torch.Tensor]:
        """All rows: ``(ids, features [N, ...], labels [N])``."""
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        ids: list[str] = []
        feats, labels = [], []
        for path in self._chunks:
            try:
                t = load_file(str(path))
            except (SafetensorError, OSError) as exc:
                raise _corrupt_chunk(path, exc) from None
            ids.extend(self._meta(path, "ids"))
            feats.append(t["features"])
            labels.append(t["labels"])
        if not feats:
            raise CheckpointError(f"the feature cache {self.root} is empty")
        return ids, torch.cat(feats), torch.cat(labels)


def example_key(e: QAExample) -> str:
    """A short hash of what an example's features and labels are computed from: its question and gold answers."""
    text = e.question + "\x1f" + "\x1e".join(sorted(e.answers))
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _corrupt_chunk(path: Path, exc: BaseException) -> CheckpointError:
    """The error of a chunk that cannot be read (a truncated file, metadata that is not ours)."""
    return CheckpointError(f"the feature cache's chunk {path} is corrupt ({exc}): delete it (its questions are "
                           "computed again) or use another --cache")


def _batches(items: list[QAExample], size: int) -> Iterator[list[QAExample]]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="q", disable=not enabled)


def prober_features(engine: Engine, retriever, examples: list[QAExample], layers: tuple[int, ...],
                    cache: FeatureCache, *, k: int = 3, passage_words: int = 60, max_tokens: int = 64,
                    batch_size: int = 16, progress: bool = True) -> None:
    """Probing-RAG's training set: each question answered with a chain of thought without and with retrieval
    (BM25 top-k on the question); the feature is the mean hidden state of the generated tokens at each layer
    ``[L, d]`` (from the engine's running sums); the label is 1 when the extracted answer is correct."""
    cfg = GenerationConfig(max_new_tokens=max_tokens, stop=("\n",))
    taps = TapSpec(layers=tuple(layers))
    cache.check(examples)
    todo = [e for e in examples if not cache.finished(e.id)]
    with _progress(len(examples), "prober features", progress) as bar:
        bar.update(len(examples) - len(todo))
        for batch in _batches(todo, batch_size):
            qs = [e.question for e in batch]
            hits = retriever.search_batch(qs, k)
            prompts = [cot_prompt(q) for q in qs] + [cot_prompt(q, [h.passage for h in hs], passage_words)
                                                      for q, hs in zip(qs, hits)]
            out = engine.generate(prompts, cfg, taps)
            ids, rows, labels = [], [], []
            for j, s in enumerate(out.sequences):
                if float(out.count[j]) <= 0:
                    continue  # nothing generated: no mean to learn from
                e = batch[j % len(batch)]
                ids.append(f"{e.id}#{'rag' if j >= len(batch) else 'closed'}")
                rows.append(out.running_sum[j] / out.count[j])  # [L, d]
                labels.append(int(accuracy(extract_answer(s.text), e.answers)))
            if rows:
                cache.add(ids, torch.stack(rows), torch.tensor(labels), batch)
            bar.update(len(batch))


def confidence_features(engine: Engine, examples: list[QAExample], layer: int, cache: FeatureCache, *,
                        max_tokens: int = 16, batch_size: int = 32, progress: bool = True) -> None:
    """CBDR's confidence set: the pre-answer state ``[1, d]`` of the direct-answer prompt at ``layer``, labelled 1
    when the model's direct greedy answer is correct. One generate call gives both (the state comes from the
    prefill)."""
    cfg = GenerationConfig(max_new_tokens=max_tokens, stop=ANSWER_STOP)
    taps = TapSpec(pre_answer=True, mid_layer=layer)
    cache.check(examples)
    todo = [e for e in examples if not cache.finished(e.id)]
    with _progress(len(examples), "confidence features", progress) as bar:
        bar.update(len(examples) - len(todo))
        for batch in _batches(todo, batch_size):
            out = engine.generate([closed_book_prompt(e.question) for e in batch], cfg, taps)
            labels = [int(accuracy(s.text.strip(), e.answers)) for e, s in zip(batch, out.sequences)]
            cache.add([e.id for e in batch], out.pre_answer[:, None, :], torch.tensor(labels), batch)
            bar.update(len(batch))
