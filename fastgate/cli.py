"""Command-line interface: ``fastgate ask | index | prepare | methods``.

User errors print one line (``fastgate: error: ...``) and exit with status 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from fastgate.errors import FastgateError, InputError

__all__ = ["main"]


def _parse_params(items: list[str] | None) -> dict[str, str]:
    params: dict[str, str] = {}
    for item in items or []:
        if "=" not in item:
            raise InputError(f"--param expects name=value, got {item!r}")
        key, value = item.split("=", 1)
        params[key.strip()] = value.strip()
    return params


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="embedded model (smollm2-135m, gemma3-270m) or a local HF directory (default: %(default)s)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu or cuda (default: %(default)s)")


def _cmd_ask(args: argparse.Namespace) -> int:
    from fastgate.calibration import calibrated_params
    from fastgate.errors import UnknownNameError
    from fastgate.methods import METHODS, build_method, make_config
    from fastgate.retrieval import RETRIEVERS

    # validate cheap things before loading anything heavy
    if args.method not in METHODS:
        raise UnknownNameError("method", args.method, list(METHODS))
    if args.retriever is None:
        args.retriever = METHODS[args.method].default_retriever
    if args.retriever not in RETRIEVERS:
        raise UnknownNameError("retriever", args.retriever, RETRIEVERS)
    questions = [q.strip() for q in args.question]
    if not questions or any(not q for q in questions):
        raise InputError("the question is empty")
    params: dict[str, Any] = _parse_params(args.param)
    if args.k is not None:
        params["k"] = args.k
    if args.max_tokens is not None:
        params["max_answer_tokens"] = args.max_tokens
    # reject bad parameters and missing checkpoints before loading anything
    METHODS[args.method].preflight(make_config(args.method, params), args.model)

    t0 = time.perf_counter()
    from fastgate.engine import Engine
    from fastgate.models import load
    from fastgate.retrieval import open_retriever

    retriever = None
    if METHODS[args.method].needs_retriever:  # before the model: a bad index fails fast
        retriever = open_retriever(args.retriever, args.index)
    lm = load(args.model, device=args.device)
    if not args.paper_defaults:
        params = calibrated_params(lm.name, args.method, params)
    engine = Engine(lm)
    method = build_method(args.method, engine, retriever, params)
    setup_s = time.perf_counter() - t0
    results = method.answer_batch(questions)
    for r in results:
        record = r.to_dict()
        record.update({"model": lm.name, "retriever": args.retriever if retriever is not None else None})
        record["timings"] = {**record["timings"], "setup_s": setup_s}
        if args.json:
            print(json.dumps(record, ensure_ascii=False))
        else:
            _print_human(record)
    return 0


def _print_human(r: dict[str, Any]) -> None:
    print(f"Q: {r['question']}")
    print(f"A: {r['answer'] or '(empty answer)'}")
    decision = f"yes ({r['retrieval_calls']}×)" if r["retrieved"] else "no"
    print(f"   method {r['method']} · retrieved: {decision}")
    for n, step in enumerate(r["gate_steps"], 1):
        action = "retrieve" if step["retrieve"] else "skip"
        print(f"   gate {n}: {step['gate']} {step['score']:.3f} vs threshold {step['threshold']:.3g} -> {action}")
    for i, p in enumerate(r["passages"], 1):
        print(f"   [{i}] {p['title']} (score {p['score']:.3f}, id {p['id']})")
    t = r["timings"]
    print(f"   {r['lm_calls']} LM call(s), {r['retrieval_calls']} retrieval call(s), {r['generated_tokens']} generated "
          f"tokens; {t.get('total_s', 0):.2f} s answering (generation {t.get('generation_s', 0):.2f} s, retrieval "
          f"{t.get('retrieval_s', 0):.3f} s, gate {t.get('gate_s', 0) * 1000:.2f} ms), "
          f"setup {t.get('setup_s', 0):.1f} s"
          + (" · prompt truncated to fit the context" if r.get("truncated") else ""))
    print()


def _cmd_index(args: argparse.Namespace) -> int:
    from fastgate.retrieval import RETRIEVERS, build_indexes

    kinds = RETRIEVERS if args.retriever == "all" else (args.retriever,)
    built = build_indexes(args.corpus, args.out, kinds=kinds, hnsw=args.hnsw, progress=True, force=args.force)
    for kind, path in built.items():
        print(f"{kind}: {path}")
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    from fastgate.models import MODELS, prepare
    from fastgate.retrieval import RETRIEVERS, build_indexes

    if args.model in MODELS:
        path = prepare(args.model)
        print(f"model {args.model}: {path}")
    kinds = RETRIEVERS if args.retriever == "all" else (args.retriever,)
    for kind, path in build_indexes("default", None, kinds=kinds, progress=True).items():
        print(f"{kind} index: {path}")
    return 0


def _cmd_methods(args: argparse.Namespace) -> int:
    from fastgate.calibration import CALIBRATED
    from fastgate.methods import METHODS

    for name, cls in METHODS.items():
        print(f"{name}: {cls.description}")
        for key, default in cls.parameters().items():
            tuned = {m: c[name][key] for m, c in CALIBRATED.items() if key in c.get(name, {})}
            extra = "".join(f" ({m}: {v})" for m, v in tuned.items())
            print(f"    {key} = {default!r}{extra}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastgate", description="Adaptive retrieval-augmented generation gated on the model's own signals."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    ask = sub.add_parser("ask", help="answer one or more questions with gated retrieval",
                         description="Answer questions; several questions run as one batch.")
    ask.add_argument("question", nargs="+", help="the question(s)")
    ask.add_argument("--method", default="dtr",
                     help="never | always | flare | probing | dtr | seakr | scaar | cbdr (default: %(default)s)")
    ask.add_argument("--retriever", default=None,
                     help="bm25 | dense (default: the method's: dense for dtr, bm25 for the others)")
    ask.add_argument("--k", type=int, default=None, help="passages per retrieval (default: the method's, 3)")
    ask.add_argument("--index", default=None,
                     help="index root holding bm25/ and dense/ (default: the default corpus, built on first use)")
    ask.add_argument("--param", action="append", metavar="NAME=VALUE",
                     help="method parameter, repeatable (see `fastgate methods`)")
    ask.add_argument("--max-tokens", type=int, default=None, help="maximum answer tokens")
    ask.add_argument("--paper-defaults", action="store_true",
                     help="use the papers' thresholds instead of the values calibrated for the model")
    ask.add_argument("--json", action="store_true", help="print one JSON object per question")
    _add_model_args(ask)
    ask.set_defaults(func=_cmd_ask)

    index = sub.add_parser("index", help="build BM25 and/or dense indexes for a corpus",
                           description="Build indexes of a JSONL corpus ({\"id\",\"title\",\"text\"} per line) or "
                                       "of the default corpus. Up-to-date indexes are kept.")
    index.add_argument("--corpus", default="default", help="'default' or a JSONL file (default: %(default)s)")
    index.add_argument("--out", default=None, help="output root (default: $FASTGATE_HOME/indexes/<corpus>)")
    index.add_argument("--retriever", default="all", choices=["all", "bm25", "dense"], help="which index to build")
    index.add_argument("--hnsw", action="store_true", help="dense: HNSW graph instead of exact flat inner product")
    index.add_argument("--force", action="store_true", help="rebuild even if up to date")
    index.set_defaults(func=_cmd_index)

    prep = sub.add_parser("prepare", help="convert the embedded model and build the default indexes (cached)")
    prep.add_argument("--model", default="smollm2-135m", help="embedded model to convert (default: %(default)s)")
    prep.add_argument("--retriever", default="all", choices=["all", "bm25", "dense"])
    prep.set_defaults(func=_cmd_prepare)

    methods = sub.add_parser("methods", help="list the methods with their parameters and defaults")
    methods.set_defaults(func=_cmd_methods)

    from fastgate.train.cli import add_train_parser

    add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return int(args.func(args) or 0)
    except FastgateError as exc:
        print(f"fastgate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fastgate: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
