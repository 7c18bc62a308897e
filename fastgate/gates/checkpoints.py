"""Learned gates' checkpoints: the Probing-RAG prober module, stacking into :class:`ProbeParams`, and checkpoint I/O.

(The prober gate that runs these weights is :mod:`fastgate.gates.prober`; its fused kernel, ``kernels/probe.py``.)

A checkpoint is a directory with ``weights.safetensors`` (the stacked :class:`ProbeParams` tensors) and
``config.json`` recording which model it was trained for (name, weight fingerprint, hidden size, layer count), the
tapped layers, the hidden width, the weights' SHA-256 and free-form ``extra`` settings (e.g. a tuned threshold).
Loading checks all of it, so a checkpoint for another model or a truncated file fails with a clear message.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from fastgate.errors import CheckpointError, InputError, ShapeError
from fastgate.ops.reference import ProbeParams

__all__ = [
    "ProbeCheckpoint",
    "check_checkpoint_matches",
    "check_checkpoint_out",
    "check_out_dir",
    "checkpoint_summary",
    "Prober",
    "load_probe_checkpoint",
    "random_probe_params",
    "default_checkpoint",
    "resolve_checkpoint",
    "save_probe_checkpoint",
    "stack_probers",
]

FORMAT = "fastgate-prober"
VERSION = 1
WEIGHTS = "weights.safetensors"
CONFIG = "config.json"
Kind = Literal["probing", "confidence"]


class Prober(nn.Module):
    """Probing-RAG's released prober: LN(d) → Linear(d,h) → SiLU → LN → Dropout → Linear(h,h) → SiLU → LN → Dropout →
    Linear(h,2). CBDR's confidence model E uses the same shape on the pre-answer state."""

    def __init__(self, d: int, h: int = 512, dropout: float = 0.1) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.LayerNorm(d), nn.Linear(d, h), nn.SiLU(), nn.LayerNorm(h), nn.Dropout(dropout),
            nn.Linear(h, h), nn.SiLU(), nn.LayerNorm(h), nn.Dropout(dropout), nn.Linear(h, 2),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [..., d] -> [..., 2]
        return self.net(x)


def stack_probers(probers: list[Prober]) -> ProbeParams:
    """Stack per-layer :class:`Prober` modules into the :class:`ProbeParams` layout (Linear weights transposed)."""
    if not probers:
        raise ShapeError("stack_probers: no probers")
    parts: dict[str, list[torch.Tensor]] = {name: [] for name in ProbeParams._fields}
    for p in probers:
        ln0, l1, _, ln1, _, l2, _, ln2, _, l3 = p.net
        for name, t in (("ln0_w", ln0.weight), ("ln0_b", ln0.bias), ("w1", l1.weight.T), ("b1", l1.bias),
                        ("ln1_w", ln1.weight), ("ln1_b", ln1.bias), ("w2", l2.weight.T), ("b2", l2.bias),
                        ("ln2_w", ln2.weight), ("ln2_b", ln2.bias), ("w3", l3.weight.T), ("b3", l3.bias)):
            parts[name].append(t.detach().to(torch.float32))
    params = ProbeParams(*(torch.stack(parts[name]).contiguous() for name in ProbeParams._fields))
    params.validate()
    return params


def random_probe_params(n_layers: int, d: int, h: int = 64, seed: int = 0) -> ProbeParams:
    """Randomly initialised probers (for tests and for running the pipelines before training)."""
    torch.manual_seed(seed)
    probers = [Prober(d, h) for _ in range(n_layers)]
    with torch.no_grad():  # LayerNorm affine parameters start at 1/0; perturb them so tests exercise them
        for p in probers:
            for m in p.net:
                if isinstance(m, nn.LayerNorm):
                    m.weight.add_(0.1 * torch.randn_like(m.weight))
                    m.bias.add_(0.1 * torch.randn_like(m.bias))
    return stack_probers(probers)


@dataclass(frozen=True)
class ProbeCheckpoint:
    """Loaded checkpoint: the stacked weights and what they were trained for."""

    params: ProbeParams
    kind: Kind
    model: str
    model_fingerprint: str
    hidden_size: int
    model_layers: int
    layers: tuple[int, ...]  # HF hidden_states indices the probers read; (mid,) for the confidence model
    extra: dict[str, Any] = field(default_factory=dict)
    path: str = ""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def save_probe_checkpoint(out_dir: str | Path, params: ProbeParams, *, kind: Kind, model: Any, layers: tuple[int, ...],
                          extra: dict[str, Any] | None = None) -> Path:
    """Write ``params`` for ``model`` (a :class:`~fastgate.assets.models.LoadedModel`) atomically to ``out_dir``."""
    from safetensors.torch import save_file

    params.validate()
    if len(layers) != params.n_layers:
        raise ShapeError(f"{len(layers)} layers given for {params.n_layers} probers")
    if params.d != model.hidden_size:
        raise ShapeError(f"probers take d={params.d} but model {model.name} has hidden size {model.hidden_size}")
    out = Path(out_dir)
    check_checkpoint_out(out, kind)
    out.parent.mkdir(parents=True, exist_ok=True)
    fresh = not out.exists()
    # a new directory is built beside its place and moved in whole. An existing checkpoint (anything else the user
    # keeps there stays) gets its new weights under a name of their own first, then the config naming them: replacing
    # the config is the one step that switches, so a crash leaves the old checkpoint or the new one, never neither
    # (weights replaced before the config left new weights beside the old config, which refused them: both lost)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent if fresh else out))
    try:
        save_file({name: t.detach().cpu().contiguous() for name, t in zip(ProbeParams._fields, params)}, tmp / WEIGHTS)
        digest = _sha256(tmp / WEIGHTS)
        name = WEIGHTS if fresh else f"weights-{digest[:16]}.safetensors"
        config = {
            "format": FORMAT, "version": VERSION, "kind": kind, "model": model.name,
            "model_fingerprint": model.fingerprint, "hidden_size": model.hidden_size, "model_layers": model.n_layers,
            "layers": list(layers), "h": params.h, "weights_sha256": digest, "extra": extra or {},
            **({} if name == WEIGHTS else {"weights": name}),
        }
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if fresh:
            os.chmod(tmp, 0o755)  # mkdtemp's 0700 would keep other users of a shared checkpoint out
            os.replace(tmp, out)
        else:
            os.replace(tmp / WEIGHTS, out / name)
            os.replace(tmp / CONFIG, out / CONFIG)  # the switch
            for old in (out / WEIGHTS, *out.glob("weights-*.safetensors")):  # the weights no config names now
                if old.name != name:
                    old.unlink(missing_ok=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_out_dir(out: Path, marker: str, fmt: str, what: str, kept: str, kind: str | None = None) -> None:
    """``out`` may receive a saved model: absent, an empty directory, or one of ours (its JSON file ``marker`` names
    ``fmt`` as its format), which is replaced; never a directory of the user's other files. ``what`` names the kind in
    the message, ``kept`` the one to replace. With ``kind``, one of ours must also be of that ``kind`` (its marker's
    ``kind`` field): a probing checkpoint was replaced by a confidence model (``train confidence --out``) unasked.

    Raises:
        InputError: a file, a directory holding something other than a fastgate ``what``, or one of another
            ``kind`` (both kinds named)."""
    if not os.path.lexists(out):
        return
    if not out.is_dir():
        raise InputError(f"{out} exists and is not a directory: choose another --out")
    if not any(out.iterdir()):
        return
    try:
        doc = json.loads((out / marker).read_text())
        ours = doc.get("format") == fmt
    except (OSError, ValueError, AttributeError):
        doc, ours = None, False
    if not ours:
        raise InputError(f"{out} holds files that are not a fastgate {what}: not overwriting them; "
                         f"choose another --out (a new or empty directory, or a {kept} to replace)")
    if kind is not None and doc.get("kind") != kind:
        raise InputError(f"{out} holds a {doc.get('kind')} {kept}, and this is a {kind} {kept}: not replacing it; "
                         f"choose another --out (a new or empty directory, or a {kind} {kept} to replace)")


def check_checkpoint_out(out: Path, kind: Kind | None = None) -> None:
    """``out`` may receive a checkpoint (of ``kind``, where given): an empty directory or a prober checkpoint (of that
    kind), never a user's other files nor a checkpoint of the other kind.

    Raises:
        InputError: a file, a directory holding something other than a fastgate prober checkpoint, or a checkpoint of
            another kind."""
    check_out_dir(out, CONFIG, FORMAT, "prober checkpoint", "checkpoint", kind)


def load_probe_checkpoint(path: str | Path, model: Any | None = None, kind: Kind | None = None) -> ProbeCheckpoint:
    """Load and verify a checkpoint; with ``model`` given, it must have been trained for that model.

    Raises:
        CheckpointError: missing or unreadable files, a hash mismatch (truncated/corrupt weights), inconsistent
            shapes, the wrong kind, or a checkpoint for a different model.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"no checkpoint directory at {root}")
    try:
        config = json.loads((root / CONFIG).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{root} has no {CONFIG}; is it a fastgate prober checkpoint?") from None
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8 text at all
        raise CheckpointError(f"cannot read {root / CONFIG}: {exc}") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise CheckpointError(f"{root / CONFIG} is not a {FORMAT} config")
    if config.get("version") != VERSION:
        raise CheckpointError(f"{root} has checkpoint version {config.get('version')}; this fastgate reads {VERSION}")
    if kind is not None and config.get("kind") != kind:
        raise CheckpointError(f"{root} holds a {config.get('kind')!r} checkpoint, not {kind!r}")
    name = config.get("weights", WEIGHTS)  # a checkpoint replaced in place names its weights' own file
    if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
        raise CheckpointError(f"{root / CONFIG}: weights must be a .safetensors file name in it, got {name!r}")
    weights = root / name
    if not weights.is_file():
        raise CheckpointError(f"{root} has no {name}")
    if _sha256(weights) != config.get("weights_sha256"):
        raise CheckpointError(f"{weights} does not match its recorded SHA-256: truncated or corrupt")
    try:
        tensors = load_file(str(weights))
        params = ProbeParams(*(tensors[name].to(torch.float32) for name in ProbeParams._fields))
        params.validate()
    except (SafetensorError, KeyError, ShapeError, OSError) as exc:
        raise CheckpointError(f"cannot load {weights}: {exc}") from None
    # the config's own fields, typed: a hand-edited or foreign one is a CheckpointError, never a KeyError / TypeError
    layers, extra = config.get("layers", []), config.get("extra", {})
    if config.get("kind") not in typing.get_args(Kind):
        raise CheckpointError(f"{root / CONFIG}: kind must be one of {', '.join(typing.get_args(Kind))}, "
                              f"got {config.get('kind')!r}")
    if not isinstance(layers, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in layers):
        raise CheckpointError(f"{root / CONFIG}: layers must be a list of layer numbers, got {layers!r}")
    if not isinstance(extra, dict):
        raise CheckpointError(f"{root / CONFIG}: extra must be an object, got {extra!r}")
    for name in ("hidden_size", "model_layers"):
        if not isinstance(config.get(name, 0), int) or isinstance(config.get(name, 0), bool):
            raise CheckpointError(f"{root / CONFIG}: {name} must be an integer, got {config.get(name)!r}")
    layers = tuple(layers)
    if len(layers) != params.n_layers or params.d != config.get("hidden_size"):
        raise CheckpointError(f"{root}: config says layers={list(layers)}, d={config.get('hidden_size')} but the "
                              f"weights hold {params.n_layers} probers of d={params.d}")
    ckpt = ProbeCheckpoint(params, config["kind"], str(config.get("model", "")),
                           str(config.get("model_fingerprint", "")), int(config["hidden_size"]),
                           int(config.get("model_layers", 0)), layers, dict(extra), str(root))
    if model is not None:
        check_checkpoint_matches(ckpt, model)
    return ckpt


DEFAULT_CHECKPOINTS = Path(__file__).resolve().parents[1] / "checkpoints"  # shipped weights: <model>-<kind>/


def default_checkpoint(model_name: str | None, kind: Kind) -> Path | None:
    """The shipped checkpoint of ``kind`` for a built-in model, if there is one."""
    if not model_name:
        return None
    path = DEFAULT_CHECKPOINTS / f"{model_name}-{kind}"
    return path if (path / CONFIG).is_file() else None


def resolve_checkpoint(path: str, model_name: str | None, kind: Kind, method: str, trainer: str) -> Path:
    """The checkpoint directory a learned gate will load: ``path`` if given, else the shipped default for the model.

    Runs before any model loads, so a missing checkpoint fails fast.
    """
    if path:
        if not Path(path).is_dir():
            raise CheckpointError(f"no checkpoint directory at {path}")
        return Path(path)
    found = default_checkpoint(model_name, kind)
    if found is None:
        raise CheckpointError(f"{method} needs a {kind} checkpoint and none ships for model {model_name or '?'}: "
                              f"pass --param checkpoint=DIR (train one: `{trainer}`)")
    return found


def check_checkpoint_matches(ckpt: ProbeCheckpoint, model: Any) -> None:
    """Raise :class:`CheckpointError` unless ``ckpt`` was trained for ``model`` (same weights and shapes)."""
    if ckpt.hidden_size != model.hidden_size or ckpt.model_layers != model.n_layers:
        raise CheckpointError(
            f"checkpoint {ckpt.path} is for {ckpt.model} (hidden size {ckpt.hidden_size}, {ckpt.model_layers} layers); "
            f"model {model.name} has hidden size {model.hidden_size} and {model.n_layers} layers"
        )
    if ckpt.model_fingerprint and model.fingerprint and ckpt.model_fingerprint != model.fingerprint:
        raise CheckpointError(
            f"checkpoint {ckpt.path} was trained for model {ckpt.model} (weights {ckpt.model_fingerprint}); the "
            f"loaded model {model.name} has weights {model.fingerprint}. Train probers for this model with "
            f"`fastgate train`"
        )
    if any(not 0 <= layer <= model.n_layers for layer in ckpt.layers):
        raise CheckpointError(f"checkpoint {ckpt.path} taps layers {list(ckpt.layers)} outside 0..{model.n_layers}")


def checkpoint_summary(ckpt: ProbeCheckpoint) -> dict[str, Any]:
    """JSON-friendly description (no tensors)."""
    return {f.name: getattr(ckpt, f.name) for f in fields(ckpt) if f.name != "params"}
