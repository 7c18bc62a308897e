"""CBDR's reranker: preference data from the confidence shift Inc(Q,C), and an InfoNCE fine-tune of the MiniLM
embedder that ranks passages by cosine to the question (saved sentence-transformers-compatible)."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from fastgate.errors import InputError
from fastgate.eval.datasets import QAExample
from fastgate.gates.checkpoints import check_out_dir
from fastgate.prompts import closed_book_prompt, rag_prompt

__all__ = ["Preference", "RerankerConfig", "check_reranker_out", "fit_reranker", "shift_preferences"]

# files of a sentence-transformers model directory besides the HF weights and tokenizer
_ST_FILES = ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling")
# written last into every reranker directory fastgate saves: what marks one as ours (replaceable by a new training)
MARKER = "fastgate_reranker.json"
FORMAT = "fastgate-reranker"


@dataclass(frozen=True)
class Preference:
    """One question with the passages that raised (positives) and lowered (negatives) the model's confidence."""

    question: str
    positives: tuple[str, ...]
    negatives: tuple[str, ...]


def shift_preferences(engine, gate, retriever, examples: list[QAExample], *, n_candidates: int = 20, top: int = 5,
                      passage_words: int = 120, progress: bool = True) -> list[Preference]:
    """For each question, Inc(Q,C) = Conf(Q+C) − Conf(Q) over the retriever's top-N; the ``top`` largest increases
    are positives, the ``top`` largest decreases negatives (CBDR §3). Questions without both are skipped."""
    from tqdm.auto import tqdm

    out = []
    for e in tqdm(examples, desc="confidence shift", unit="q", disable=not progress):
        hits = retriever.search(e.question, n_candidates)
        if not hits:
            continue
        prompts = [closed_book_prompt(e.question)] + [rag_prompt(e.question, [h.passage], passage_words) for h in hits]
        conf = gate.confidence(engine.prompt_states(prompts, gate.layer)).tolist()  # one batched prefill
        inc = sorted(((conf[j + 1] - conf[0], h.text) for j, h in enumerate(hits)), key=lambda t: -t[0])
        pos = tuple(t for v, t in inc[:top] if v > 0)
        neg = tuple(t for v, t in inc[::-1][:top] if v < 0)
        if pos and neg:
            out.append(Preference(e.question, pos, neg))
    return out


@dataclass(frozen=True)
class RerankerConfig:
    """Fine-tuning settings (CBDR App. C for its reranker: lr 6e-5, weight decay 0.01, 1 epoch)."""

    epochs: int = 1
    lr: float = 6e-5
    weight_decay: float = 0.01
    temperature: float = 0.05  # InfoNCE temperature on cosine similarities
    batch_size: int = 8  # questions per step; the other questions' positives are extra negatives
    max_length: int = 128
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "max_length"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "temperature"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise InputError(f"{name} must be a finite number > 0, got {getattr(self, name)}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise InputError(f"weight_decay must be a finite number >= 0, got {self.weight_decay}")


def check_reranker_out(out: Path) -> None:
    """``out`` may receive a reranker: absent, an empty directory or a reranker fastgate saved (never a user's
    other files).

    Raises:
        InputError: a file, or a directory holding something other than a fastgate reranker."""
    check_out_dir(out, MARKER, FORMAT, "reranker", "reranker")


def _save_reranker(out: Path, write: Callable[[Path], None], info: dict) -> Path:
    """Build the reranker directory beside ``out`` (``write`` fills it, the marker goes in last) and move it into
    place whole: an interrupted save leaves ``out`` as it was, and an existing reranker is replaced only at the end."""
    check_reranker_out(out)  # again: the directory may have changed during the training
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    old = tmp.with_name(tmp.name + ".old")  # unique beside tmp, not yet there
    placed = False
    try:
        write(tmp)
        (tmp / MARKER).write_text(json.dumps({"format": FORMAT, "version": 1, **info}, indent=2) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep other users of a shared reranker out
        if os.path.lexists(out):
            os.replace(out, old)
            try:
                os.replace(tmp, out)
            except BaseException:
                os.replace(old, out)
                raise
        else:
            os.replace(tmp, out)
        placed = True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if placed and os.path.lexists(old):
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink()
    return out


def _embed(model, tokenizer, texts: list[str], max_length: int) -> torch.Tensor:
    enc = tokenizer(texts, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
    hidden = model(**enc).last_hidden_state  # [n, T, h]
    mask = enc["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1).clamp_min(1.0), dim=-1)  # [n, h]


def fit_reranker(prefs: list[Preference], out_dir: str | Path, base: str | Path | None = None,
                 cfg: RerankerConfig = RerankerConfig()) -> list[float]:
    """InfoNCE fine-tune of the embedder on ``prefs``: each question against one positive, its negatives and the
    batch's other positives. Saves a sentence-transformers-compatible directory (atomically; refusing an ``out_dir``
    that holds other files than a reranker of ours); returns the loss per step."""
    from transformers import AutoModel, AutoTokenizer

    from fastgate.assets.embedder import default_embedder_path

    out = Path(out_dir)
    check_reranker_out(out)  # before the training, not after it
    if not prefs:
        raise InputError("fit_reranker: no preference pairs (no question had both an increase and a decrease)")
    base = Path(base) if base is not None else default_embedder_path()
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    model = AutoModel.from_pretrained(str(base))
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    losses = []
    for _ in range(cfg.epochs):
        order = list(prefs)
        rng.shuffle(order)
        for start in range(0, len(order), cfg.batch_size):
            batch = order[start:start + cfg.batch_size]
            q = _embed(model, tokenizer, [p.question for p in batch], cfg.max_length)  # [b, h]
            pos = _embed(model, tokenizer, [rng.choice(p.positives) for p in batch], cfg.max_length)  # [b, h]
            negs = [n for p in batch for n in p.negatives]
            neg = _embed(model, tokenizer, negs, cfg.max_length)  # [m, h]
            logits = torch.cat([q @ pos.T, q @ neg.T], dim=1) / cfg.temperature  # [b, b + m]
            loss = torch.nn.functional.cross_entropy(logits, torch.arange(len(batch)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))

    def write(tmp: Path) -> None:
        model.save_pretrained(str(tmp))
        tokenizer.save_pretrained(str(tmp))
        for name in _ST_FILES:
            src = base / name
            if src.is_dir():
                shutil.copytree(src, tmp / name, dirs_exist_ok=True)
            elif src.is_file():
                shutil.copy2(src, tmp / name)

    _save_reranker(out, write, {"base": str(base), "config": asdict(cfg), "losses": losses})
    return losses
