"""``fastgate train prober|confidence``: extract (cached, resumable) features, fit, save a checkpoint."""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import sys
from pathlib import Path

from fastgate.assets.pins import DEFAULT_MODEL
from fastgate.errors import InputError
from fastgate.settings import count

__all__ = ["add_train_args"]


def _layers(text: str | None, one: bool) -> tuple[int, ...] | None:
    """``--layers``: comma-separated layer numbers >= 0 (one only where ``one``); None when not given."""
    if not text:
        return None
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isascii() and p.isdigit() for p in parts):
        raise InputError(f"--layers takes comma-separated layer numbers >= 0, got {text!r}")
    if one and len(parts) != 1:
        raise InputError(f"--layers takes one layer for the confidence probe, got {text!r}")
    return tuple(int(p) for p in parts)


def _examples(args: argparse.Namespace):
    from fastgate.eval.datasets import load_qa, refuse_test_split, split_examples

    refuse_test_split(args.data, f"fastgate train {args.kind}")
    train, held_out = split_examples(load_qa(args.data))
    rng = random.Random(args.seed)
    rng.shuffle(train)
    if args.n:
        train = train[: args.n]
    print(f"{len(train)} training questions from {args.data} ({len(held_out)} held out for evaluation)")
    return train


def _cache_dir(args: argparse.Namespace, lm, meta: dict) -> Path:
    if args.cache:
        return Path(args.cache)
    from fastgate.assets.paths import home

    key = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:12]
    return home() / "features" / f"{lm.name}-{meta['kind']}-{key}"


def _labelled_features(args: argparse.Namespace, lm, engine, examples, kind: str, layers: tuple[int, ...],
                       suffix: str = ""):
    """Extract (or resume) the features of ``examples`` for a ``probing`` or ``confidence`` gate and return the rows
    of those examples: ``(features, labels, cache)``. ``suffix`` keeps held-out features in their own cache."""
    import torch

    from fastgate.train import FeatureCache, confidence_features, prober_features

    if kind == "probing":
        from fastgate.retrieval import open_retriever

        # the index read: a cache of another --index held other passages' rows (the default's key is absent, as in
        # caches made before it was kept)
        index = {"index": str(Path(args.index).resolve())} if getattr(args, "index", None) else {}
        meta = {"kind": "prober" + suffix, "model": lm.fingerprint, "layers": list(layers), "k": args.k, **index}
        cache = FeatureCache(_cache_dir(args, lm, meta), meta)
        prober_features(engine, open_retriever("bm25", args.index), examples, layers, cache, k=args.k,
                        batch_size=getattr(args, "batch_size", 16))
    else:
        meta = {"kind": "confidence" + suffix, "model": lm.fingerprint, "layer": layers[0]}
        cache = FeatureCache(_cache_dir(args, lm, meta), meta)
        confidence_features(engine, examples, layers[0], cache, batch_size=getattr(args, "batch_size", 32))
    wanted = {e.id for e in examples}
    ids, feats, labels = cache.load()
    # a prober row's id is its example's plus "#rag" or "#closed" (the example's own id may hold "#" too)
    keep = torch.tensor([(i.rpartition("#")[0] if kind == "probing" else i) in wanted for i in ids])
    return feats[keep], labels[keep], cache


def _report(results, layers) -> dict:
    print(f"{'layer':>5}  {'val acc':>7}  {'majority':>8}  losses")
    for layer, r in zip(layers, results):
        print(f"{layer:>5}  {r.val_accuracy:7.3f}  {r.majority_accuracy:8.3f}  " +
              " ".join(f"{x:.3f}" for x in r.losses))
    return {"val_accuracy": {str(layer): r.val_accuracy for layer, r in zip(layers, results)},
            "majority_accuracy": results[0].majority_accuracy}


def _cmd_train(args: argparse.Namespace) -> int:
    import torch

    from fastgate.assets.models import load
    from fastgate.engine.local import Engine
    from fastgate.gates.checkpoints import check_checkpoint_out, save_probe_checkpoint
    from fastgate.train import FitConfig, fit_probers

    # the settings are checked before the model loads: a bad flag is one line, not a traceback minutes later
    cfg = FitConfig(hidden=args.hidden, epochs=args.epochs, lr=args.lr, dropout=args.dropout, seed=args.seed)
    if args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    asked = _layers(args.layers, one=args.kind != "prober")  # checked before the model loads
    if args.out:  # before the training's minutes, not after them; a checkpoint of the other kind is not replaced
        check_checkpoint_out(Path(args.out), "probing" if args.kind == "prober" else "confidence")
    examples = _examples(args)
    lm = load(args.model, device=args.device, weights="float")  # fitted and judged on the float weights' states
    engine = Engine(lm)
    torch.manual_seed(args.seed)
    if args.kind == "prober":
        from fastgate.methods.probing import default_probe_layers

        layers = asked or default_probe_layers(lm.n_layers)
        kind = "probing"
    else:
        layers = asked or (lm.n_layers // 2,)
        kind = "confidence"
    if max(layers) > lm.n_layers:  # the hidden states a checkpoint may tap: 0 (embeddings) .. n_layers (the output)
        raise InputError(f"--layers {args.layers}: {args.model} has hidden states 0 to {lm.n_layers} ({lm.n_layers} "
                         "layers)")
    feats, labels, cache = _labelled_features(args, lm, engine, examples, kind, layers)
    print(f"{len(labels)} labelled rows, {int(labels.sum())} correct ({float(labels.float().mean()):.1%}); "
          f"cache {cache.root}")
    if int(labels.min()) == int(labels.max()):  # a probe of one class learns that class: say it before it is saved
        print(f"fastgate: warning: all {len(labels)} rows are {'correct' if int(labels[0]) else 'incorrect'}: the "
              f"{kind} model can only learn to answer that; use more --n or another --data", file=sys.stderr)
    params, results = fit_probers(feats, labels, cfg)
    extra = {**_report(results, layers), "data": str(args.data), "n_rows": len(labels),
             **({"k": args.k} if kind == "probing" else {}),  # the with-passages rows' search (train evaluate's)
             "fit": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}}
    from fastgate.assets.paths import home

    out = Path(args.out) if args.out else home() / "checkpoints" / f"{lm.name}-{kind}"
    save_probe_checkpoint(out, params, kind=kind, model=lm, layers=layers, extra=extra)
    print(f"checkpoint: {out}")
    return 0


def _cmd_evaluate(args: argparse.Namespace) -> int:
    from fastgate.assets.models import load
    from fastgate.engine.local import Engine
    from fastgate.eval.datasets import load_qa, split_examples
    from fastgate.gates.checkpoints import load_probe_checkpoint
    from fastgate.train.evaluate import evaluate_gate

    lm = load(args.model, device=args.device, weights="float")  # fitted and judged on the float weights' states
    ckpt = load_probe_checkpoint(args.checkpoint, lm)
    if args.k is None:  # the passages the checkpoint's rows read (3 for those made before it was recorded)
        args.k = int(ckpt.extra.get("k", 3)) if ckpt.kind == "probing" else 3
    _, held_out = split_examples(load_qa(args.data))
    random.Random(args.seed).shuffle(held_out)
    if args.n:
        held_out = held_out[: args.n]
    engine = Engine(lm)
    feats, labels, _ = _labelled_features(args, lm, engine, held_out, ckpt.kind, ckpt.layers, suffix="-heldout")
    threshold = args.threshold if args.threshold is not None else (0.0 if ckpt.kind == "probing" else 0.95)
    result = evaluate_gate(ckpt.params, feats, labels, kind=ckpt.kind, threshold=threshold)
    from fastgate.serving.runtime import finite  # strict JSON: an AUROC of one-label data (NaN) as null

    print(json.dumps(finite({"checkpoint": str(args.checkpoint), "kind": ckpt.kind, "threshold": threshold,
                             **result.to_dict()})))
    return 0


def _cmd_reranker(args: argparse.Namespace) -> int:
    from fastgate.assets.models import load
    from fastgate.engine.local import Engine
    from fastgate.gates.checkpoints import load_probe_checkpoint, resolve_checkpoint
    from fastgate.gates.prober import ConfidenceGate
    from fastgate.retrieval import open_retriever
    from fastgate.train.reranker import RerankerConfig, check_reranker_out, fit_reranker, shift_preferences

    # the settings and --out are checked before any model loads (a bad flag is one line, not a traceback later)
    cfg = RerankerConfig(epochs=args.epochs, lr=args.lr, seed=args.seed)
    if args.candidates < 1:
        raise InputError(f"--candidates must be >= 1, got {args.candidates}")
    check_reranker_out(Path(args.out))
    examples = _examples(args)
    retriever = open_retriever("bm25", args.index)
    lm = load(args.model, device=args.device, weights="float")  # fitted and judged on the float weights' states
    path = resolve_checkpoint(args.checkpoint or "", lm.name, "confidence", "the reranker", "fastgate train confidence")
    ckpt = load_probe_checkpoint(path, lm, kind="confidence")
    engine = Engine(lm)
    gate = ConfidenceGate(ckpt.params.to(engine.device), ckpt.layers[0], ops=engine.ops)
    prefs = shift_preferences(engine, gate, retriever, examples, n_candidates=args.candidates)
    print(f"{len(prefs)} questions with both confidence increases and decreases")
    losses = fit_reranker(prefs, args.out, cfg=cfg)
    print(f"InfoNCE loss: first {losses[0]:.3f}, last {losses[-1]:.3f} over {len(losses)} steps")
    print(f"reranker: {args.out} (use: --method cbdr --param reranker=trained --param reranker_path={args.out})")
    return 0


MODEL_HELP = "embedded model or a local HF directory (default: %(default)s)"
DEVICE_HELP = "auto (CUDA if available), cpu or cuda (default: %(default)s)"
DATA_HELP = "capitals | fanoutqa | default (both) | a JSONL file (default: %(default)s)"
INDEX_HELP = "index root holding bm25/ and dense/{} (default: the default corpus's)"
SEED_HELP = "question order and training seed (default: %(default)s)"


def add_train_args(train: argparse.ArgumentParser) -> None:
    """``fastgate train``'s kinds and their arguments on its parser ``train`` (its name and help line are the command
    line's)."""
    kinds = train.add_subparsers(dest="kind", metavar="{prober,confidence,read,evaluate,reranker}", required=True)
    ev = kinds.add_parser("evaluate", help="score a trained checkpoint on the held-out split (AUROC, decision "
                                           "accuracy vs the majority class)")
    ev.add_argument("--checkpoint", required=True, help="a prober or confidence checkpoint directory")
    ev.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    ev.add_argument("--device", default="auto", help=DEVICE_HELP)
    ev.add_argument("--data", default="default", help=DATA_HELP)
    ev.add_argument("--n", type=count, default=0, help="held-out questions to use (0 = all; default: %(default)s)")
    ev.add_argument("--threshold", type=float, default=None, help="θ (probing, default 0) or β (confidence, 0.95)")
    ev.add_argument("--index", default=None, help=INDEX_HELP.format("; a probing checkpoint reads its BM25 passages"))
    ev.add_argument("--k", type=int, default=None,
                    help="passages for the with-retrieval answers (default: the checkpoint's training k, else 3)")
    ev.add_argument("--cache", default=None, help="feature cache directory (default: under $FASTGATE_HOME)")
    ev.add_argument("--seed", type=int, default=0, help="question order (default: %(default)s)")
    ev.set_defaults(func=_cmd_evaluate)
    rr = kinds.add_parser("reranker", help="CBDR's reranker: InfoNCE fine-tune of MiniLM on confidence-shift pairs")
    rr.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    rr.add_argument("--device", default="auto", help=DEVICE_HELP)
    rr.add_argument("--data", default="default", help=DATA_HELP)
    rr.add_argument("--n", type=count, default=200, help="training questions (default: %(default)s)")
    rr.add_argument("--out", required=True, help="output directory (sentence-transformers layout)")
    rr.add_argument("--checkpoint", default=None, help="confidence model (default: the one shipped for --model)")
    rr.add_argument("--index", default=None, help=INDEX_HELP.format("; the candidates are its BM25 passages"))
    rr.add_argument("--candidates", type=int, default=20,
                    help="BM25 candidates per question (CBDR's; default: %(default)s)")
    rr.add_argument("--epochs", type=int, default=1, help="default: %(default)s")
    rr.add_argument("--lr", type=float, default=6e-5, help="default: %(default)s")
    rr.add_argument("--seed", type=int, default=0, help=SEED_HELP)
    rr.set_defaults(func=_cmd_reranker)
    from fastgate.train.read import add_read_parser

    add_read_parser(kinds)
    for kind, help_text, epochs, lr, dropout, batch in (
        ("prober", "Probing-RAG probers on CoT answers without and with retrieval", 2, 1e-4, 0.1, 16),
        ("confidence", "CBDR's confidence model on pre-answer states of direct answers", 30, 5e-5, 0.5, 32),
    ):
        p = kinds.add_parser(kind, help=help_text)
        p.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
        p.add_argument("--device", default="auto", help=DEVICE_HELP)
        p.add_argument("--data", default="default", help=DATA_HELP)
        p.add_argument("--n", type=count, default=0,
                       help="training questions to use (0 = all of the training split; default: %(default)s)")
        p.add_argument("--out", default=None,
                       help="checkpoint directory (default: $FASTGATE_HOME/checkpoints/<model>-<kind>); a checkpoint "
                            "of the same kind there is replaced, one of the other kind refused")
        p.add_argument("--cache", default=None, help="feature cache directory (default: under $FASTGATE_HOME)")
        p.add_argument("--layers", default=None, help="comma-separated layers (default: the paper's choice)")
        p.add_argument("--index", default=None, help=INDEX_HELP.format("; prober: its BM25 passages"))
        p.add_argument("--k", type=int, default=3,
                       help="passages for the with-retrieval answers (default: %(default)s)")
        p.add_argument("--hidden", type=int, default=512, help="the MLP's hidden width (default: %(default)s)")
        p.add_argument("--epochs", type=int, default=epochs, help="default: %(default)s")
        p.add_argument("--lr", type=float, default=lr, help="default: %(default)s")
        p.add_argument("--dropout", type=float, default=dropout, help="default: %(default)s")
        p.add_argument("--batch-size", type=int, default=batch,
                       help="questions per generation batch (default: %(default)s)")
        p.add_argument("--seed", type=int, default=0, help=SEED_HELP)
        p.set_defaults(func=_cmd_train)
