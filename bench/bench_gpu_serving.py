"""The answer service end to end on one device, in process: what a server's users wait for while its decode steps
compile, and after.

The GPU suite's tests and benches call the engine, not the service. With sizes fixed per bucket the compiled step
compiles each (batch, width) bucket at its first step (26-47 s on an H200, the scheduler waiting), where symbolic sizes
(``auto``'s since this bench measured them, 2026-11-30) compile twice in all. This bench answers bursts of N questions
at once (``never``: one closed-book generation each of ``--max-tokens`` tokens, which random weights never end early; no
retrieval, so no index or embedder) through :class:`fastgate.serving.service.AnswerService` (no HTTP layer: fastapi and
uvicorn are not on the GPU image), on random weights in SmolLM2-135M's shapes with the tiny test tokenizer
(bench_engine.py's ``build_model``), for each step design, the unknown first:

- ``compiled-symbolic``: the compiled step with symbolic sizes (``StepConfig(sizes="symbolic")``, ``auto``'s);
- ``compiled-bucket``: the compiled step with a graph per bucket (``sizes="bucket"``; ``--bucket-bursts``, fewer sizes:
  each new one a compile);
- ``eager``: ``step="eager"`` (a CPU's ``auto``), the baseline.

Each design: the service's start (its warm-up compiles batch 1 and 2), then each burst once (``first_s``, with the
graphs compiled and captured inside it) and three times warm (``warm_s``, the median, with the captures inside: an
idle loop lets its store go, and a store at a new address is captured again), ``tokens_per_s_warm``, ``mode``
(``eager-fallback`` where a compile failed), ``reserved_mb`` (torch's CUDA allocator). Each row is appended to
``bench/results/gpu_serving.csv`` (``FASTGATE_BENCH_RESULTS``) as measured; a design that fails is said and the next
one runs; ``--max-minutes`` starts no burst past it.

Run: ``python bench/bench_gpu_serving.py --device cuda`` (the GPU suite's ``serving`` part); on a CPU, ``--device cpu
--backend eager`` checks the command line (tracing without code generation).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fastgate.entrypoints import passive_omp_threads  # noqa: E402

passive_omp_threads()  # before torch loads (bench_engine imports it)
import torch  # noqa: E402
from _common import append_rows, print_table  # noqa: E402
from bench_engine import build_model, compiles, step_mode  # noqa: E402

from fastgate.engine.local import Engine  # noqa: E402
from fastgate.engine.static_step import StepConfig  # noqa: E402
from fastgate.serving.runtime import Runtime  # noqa: E402
from fastgate.serving.service import AnswerService, ServiceConfig  # noqa: E402

# the unknown first, where a call's time runs out: symbolic sizes (two compiles), then per bucket (its stalls are known:
# 26-47 s each on an H200), then eager (no compiles; a baseline)
DESIGNS = ("compiled-symbolic", "compiled-bucket", "eager")
WARM_ROUNDS = 3  # warm bursts per size, the median reported


CAPTURES = [0]  # CUDA graphs captured in this process (static_step._Graph made)


def count_captures() -> None:
    """Count :class:`fastgate.engine.static_step._Graph` captures: a warm burst can capture again where the store
    moved (an idle loop lets its store go), which a timing must not take for the step's own cost."""
    from fastgate.engine import static_step

    made = static_step._Graph.__init__

    def counted(self, *args, **kwargs):
        CAPTURES[0] += 1
        made(self, *args, **kwargs)

    static_step._Graph.__init__ = counted


def burst(svc: AnswerService, n: int, start: int, max_tokens: int, timeout: float) -> tuple[float, int]:
    """Seconds until ``n`` questions submitted at once are all answered, and the tokens they generated."""
    t = time.perf_counter()
    futures = [svc.submit(f"Question {start + i}: who wrote the play number {start + i}?", "never",
                          max_tokens=max_tokens) for i in range(n)]
    tokens = sum(int(f.result(timeout=timeout).get("generated_tokens", 0)) for f in futures)
    return time.perf_counter() - t, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="smollm2-135m-shape", help="a shape of bench_engine.py's SHAPES")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--designs", default=",".join(DESIGNS), help=f"comma-separated, of {', '.join(DESIGNS)}")
    parser.add_argument("--bursts", default="1,2,4,8,16,32", help="questions submitted at once, in this order")
    parser.add_argument("--bucket-bursts", default="1,2,4,8",
                        help="the per-bucket design's bursts (each new size a compile of 26-47 s on an H200: two "
                             "stalls measured past its warm-up's batch 1 and 2)")
    parser.add_argument("--max-tokens", type=int, default=64,
                        help="tokens a question generates (random weights never stop early): the steps, not the "
                             "prefill, fill a warm burst; the prompt and these stay within one width bucket")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (eager: a CPU smoke run)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a burst may take")
    parser.add_argument("--max-minutes", type=float, default=0.0,
                        help="start no new burst after this long (0: no limit); rows so far are written")
    parser.add_argument("--no-save", action="store_true", help="print the rows only")
    args = parser.parse_args()
    designs = [d for d in args.designs.split(",") if d]
    if set(designs) - set(DESIGNS):
        parser.error(f"unknown designs {sorted(set(designs) - set(DESIGNS))}")
    began = time.perf_counter()

    def out_of_time() -> bool:
        return bool(args.max_minutes) and time.perf_counter() - began > 60 * args.max_minutes

    count_captures()
    lm = build_model(args.model, args.device, args.dtype)
    rows = []
    for design in designs:
        if out_of_time():
            break
        bursts = [int(b) for b in (args.bucket_bursts if design == "compiled-bucket" else args.bursts).split(",")]
        step = "eager" if design == "eager" else StepConfig("compiled", backend=args.backend,
                                                           sizes=design.removeprefix("compiled-"))
        engine = Engine(lm, step=step)
        before, captured = compiles(), CAPTURES[0]
        t0 = time.perf_counter()
        svc = None
        try:  # a design that fails is said, and the next one runs
            svc = AnswerService(ServiceConfig(method="never", max_rows=max(bursts), timeout_s=args.timeout),
                                Runtime(args.model, device=args.device, engine=engine)).start()
            started = time.perf_counter() - t0
            print(f"{design}: started in {started:.1f} s (warm-up {svc.warmup_s or 0:.1f} s), "
                  f"{compiles() - before} graphs", file=sys.stderr, flush=True)
            asked = 0
            for n in bursts:
                if out_of_time():
                    break
                g0, c0 = compiles(), CAPTURES[0]
                first, tokens = burst(svc, n, asked, args.max_tokens, args.timeout)
                first_graphs, first_captures = compiles() - g0, CAPTURES[0] - c0
                asked += n
                warm, warm_captures = [], 0
                for _ in range(WARM_ROUNDS):
                    c0 = CAPTURES[0]
                    warm.append(burst(svc, n, asked, args.max_tokens, args.timeout)[0])
                    warm_captures += CAPTURES[0] - c0
                    asked += n
                reserved = svc.device_reserved_bytes
                row = {"design": design, "mode": step_mode(engine), "burst": n, "first_s": first,
                       "first_graphs": first_graphs, "first_captures": first_captures,
                       "warm_s": statistics.median(warm), "warm_captures": warm_captures,
                       "tokens": tokens, "tokens_per_s_warm": tokens / statistics.median(warm),
                       "graphs": compiles() - before, "captures": CAPTURES[0] - captured, "start_s": started,
                       "warmup_s": svc.warmup_s, "reserved_mb": None if reserved is None else reserved / 2**20,
                       "model": args.model, "dtype": engine.dtype_name, "device": svc.device_name}
                rows.append(row)
                if not args.no_save:
                    append_rows("gpu_serving", [row])  # as measured: a call cut short keeps what it had
                print(f"{design}: burst {n}: first {first:.2f} s ({first_graphs} graphs, {first_captures} "
                      f"captures), warm {row['warm_s']:.2f} s ({warm_captures} captures), {tokens} tokens",
                      file=sys.stderr, flush=True)
        except Exception as exc:  # noqa: BLE001 - said; the next design runs
            print(f"{design}: failed ({type(exc).__name__}: {exc})", file=sys.stderr, flush=True)
        finally:
            if svc is not None:
                svc.stop()
            del engine, svc
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the next design's reserved_mb its own
    if rows:
        print_table(rows, ["design", "mode", "burst", "first_s", "first_graphs", "warm_s", "warm_captures",
                           "tokens_per_s_warm", "graphs", "start_s", "reserved_mb"])


if __name__ == "__main__":
    main()
