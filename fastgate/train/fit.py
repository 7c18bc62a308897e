"""Fit probers (Probing-RAG recipe, docs/training.md) on cached features, one per layer, keeping the best epoch by
validation accuracy."""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from fastgate.errors import InputError
from fastgate.gates.checkpoints import Prober, stack_probers
from fastgate.ops import ProbeParams

__all__ = ["FitConfig", "FitResult", "fit_prober", "fit_probers"]


@dataclass(frozen=True)
class FitConfig:
    """Training settings; the defaults are Probing-RAG's (Table 6)."""

    hidden: int = 512  # prober width
    epochs: int = 2  # Probing-RAG trains 2 epochs
    lr: float = 1e-4  # AdamW learning rate
    gamma: float = 0.995  # ExponentialLR decay per epoch
    dropout: float = 0.1  # dropout after each hidden LayerNorm
    batch_size: int = 32
    weight_decay: float = 0.01  # AdamW's default
    val_fraction: float = 0.2  # held out of the training examples for choosing the epoch
    balance: bool = True  # undersample the majority class of the training part (the paper balances classes)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "hidden", "batch_size"):
            if getattr(self, name) < 1:
                raise InputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.val_fraction < 1.0:
            raise InputError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if not (math.isfinite(self.lr) and self.lr > 0):  # AdamW's own ValueError came after the model's load
            raise InputError(f"lr must be a finite number > 0, got {self.lr}")
        if not 0.0 <= self.dropout < 1.0:  # NaN fails too
            raise InputError(f"dropout must be in [0, 1), got {self.dropout}")


@dataclass
class FitResult:
    """One layer's prober and how it did."""

    prober: Prober
    val_accuracy: float
    majority_accuracy: float  # predicting the validation majority class
    losses: list[float] = field(default_factory=list)  # mean training loss per epoch


def _split(n: int, val_fraction: float, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.randperm(n, generator=generator)
    n_val = max(1, int(round(n * val_fraction)))
    return order[n_val:], order[:n_val]


def _balanced(idx: torch.Tensor, y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    pos, neg = idx[y[idx] == 1], idx[y[idx] == 0]
    m = min(len(pos), len(neg))
    if m == 0:
        return idx
    pick = lambda t: t[torch.randperm(len(t), generator=generator)[:m]]  # noqa: E731
    return torch.cat([pick(pos), pick(neg)])


@torch.no_grad()
def _accuracy(prober: Prober, x: torch.Tensor, y: torch.Tensor) -> float:
    prober.eval()
    return float((prober(x).argmax(-1) == y).float().mean())


def fit_prober(x: torch.Tensor, y: torch.Tensor, cfg: FitConfig = FitConfig()) -> FitResult:
    """Train one prober on ``x [N, d]`` with labels ``y [N]`` (1 = the answer was correct).

    The classes are balanced in the training part; after every epoch the validation accuracy is measured and the
    best epoch's weights are kept.
    """
    if x.ndim != 2 or y.shape != (x.shape[0],):
        raise InputError(f"fit_prober: expected x [N, d] and y [N], got {tuple(x.shape)} and {tuple(y.shape)}")
    if x.shape[0] < 4:
        raise InputError(f"fit_prober: need at least 4 examples, got {x.shape[0]}")
    g = torch.Generator().manual_seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    x, y = x.float(), y.long()
    train_idx, val_idx = _split(len(y), cfg.val_fraction, g)
    if cfg.balance:
        train_idx = _balanced(train_idx, y, g)
    prober = Prober(x.shape[1], cfg.hidden, cfg.dropout)
    opt = torch.optim.AdamW(prober.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=cfg.gamma)
    loss_fn = torch.nn.CrossEntropyLoss()
    best_acc, best_state, losses = -1.0, None, []
    for _ in range(cfg.epochs):
        prober.train()
        order = train_idx[torch.randperm(len(train_idx), generator=g)]
        total, count = 0.0, 0
        for start in range(0, len(order), cfg.batch_size):
            rows = order[start:start + cfg.batch_size]
            loss = loss_fn(prober(x[rows]), y[rows])
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += float(loss.detach()) * len(rows)
            count += len(rows)
        sched.step()
        losses.append(total / max(count, 1))
        acc = _accuracy(prober, x[val_idx], y[val_idx])
        if acc > best_acc:
            best_acc, best_state = acc, copy.deepcopy(prober.state_dict())
    prober.load_state_dict(best_state)
    prober.eval()
    majority = float(max(y[val_idx].float().mean(), 1 - y[val_idx].float().mean()))
    return FitResult(prober, best_acc, majority, losses)


def fit_probers(features: torch.Tensor, y: torch.Tensor, cfg: FitConfig = FitConfig()
                ) -> tuple[ProbeParams, list[FitResult]]:
    """One prober per layer on ``features [N, L, d]``; returns the stacked :class:`ProbeParams` and each layer's
    result (the same train/validation split for every layer)."""
    if features.ndim != 3:
        raise InputError(f"fit_probers: features must be [N, L, d], got {tuple(features.shape)}")
    results = [fit_prober(features[:, layer], y, cfg) for layer in range(features.shape[1])]
    return stack_probers([r.prober for r in results]), results
