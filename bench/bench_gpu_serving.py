"""The answer service end to end on one device, in process: what a server's users wait for while its decode steps
compile, and after.

No server has run end to end on a GPU here (the GPU suite's tests and benches call the engine, not the service), and
on CUDA the compiled step compiles each (batch, width) bucket at its first step with the default sizes (26-47 s on an
H200, the scheduler waiting) where symbolic sizes compile twice in all. This bench answers bursts of N questions at
once (``never``: one closed-book generation each, no retrieval, so no index or embedder is needed) through
:class:`fastgate.serving.service.AnswerService` (no HTTP layer: fastapi and uvicorn are not on the GPU image), on
random weights in SmolLM2-135M's shapes with the tiny test tokenizer (bench_engine.py's ``build_model``), for each
step design:

- ``eager``: ``step="eager"`` (a CPU's ``auto``);
- ``compiled-symbolic``: the compiled step with symbolic sizes (``StepConfig(sizes="symbolic")``);
- ``compiled-bucket``: the compiled step with a graph per bucket (CUDA's ``auto``).

Each design: the service's start (its warm-up compiles what it meets), then each burst twice: ``first_s`` (the
burst's wall time the first time: new buckets compile inside it) and ``warm_s`` (the same burst again), with
``graphs`` (dynamo's graphs compiled so far in the process) and ``reserved_mb`` (what torch's CUDA allocator holds).
Rows are appended to ``bench/results/gpu_serving.csv`` (``FASTGATE_BENCH_RESULTS``) as each design ends.

Run: ``python bench/bench_gpu_serving.py --device cuda`` (the GPU suite's ``serving`` part); on a CPU, ``--device cpu
--backend eager`` checks the command line in seconds (tracing without code generation).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fastgate.entrypoints import passive_omp_threads  # noqa: E402

passive_omp_threads()  # before torch loads (bench_engine imports it)
from _common import append_rows, print_table  # noqa: E402
from bench_engine import build_model  # noqa: E402

from fastgate.engine.local import Engine  # noqa: E402
from fastgate.engine.static_step import StepConfig  # noqa: E402
from fastgate.serving.runtime import Runtime  # noqa: E402
from fastgate.serving.service import AnswerService, ServiceConfig  # noqa: E402

# symbolic before bucket: the unknown first, where a call's time runs out (bucket's stalls are known: 26-47 s each)
DESIGNS = ("eager", "compiled-symbolic", "compiled-bucket")


def graphs() -> int:
    """Graphs dynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def burst(svc: AnswerService, n: int, start: int, timeout: float) -> float:
    """Seconds until ``n`` questions submitted at once are all answered."""
    t = time.perf_counter()
    futures = [svc.submit(f"Question {start + i}: who wrote the play number {start + i}?", "never")
               for i in range(n)]
    for f in futures:
        f.result(timeout=timeout)
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="smollm2-135m-shape", help="a shape of bench_engine.py's SHAPES")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--designs", default=",".join(DESIGNS), help=f"comma-separated, of {', '.join(DESIGNS)}")
    parser.add_argument("--bursts", default="1,2,4,8,16,32", help="questions submitted at once, in this order")
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend (eager: a CPU smoke run)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a burst may take")
    parser.add_argument("--no-save", action="store_true", help="print the rows only")
    args = parser.parse_args()
    designs = [d for d in args.designs.split(",") if d]
    if set(designs) - set(DESIGNS):
        parser.error(f"unknown designs {sorted(set(designs) - set(DESIGNS))}")
    bursts = [int(b) for b in args.bursts.split(",")]
    lm = build_model(args.model, args.device, args.dtype)
    rows = []
    for design in designs:
        step = "eager" if design == "eager" else StepConfig("compiled", backend=args.backend,
                                                           sizes=design.removeprefix("compiled-"))
        engine = Engine(lm, step=step)
        before = graphs()
        t0 = time.perf_counter()
        svc = AnswerService(ServiceConfig(method="never", max_rows=max(bursts)),
                            Runtime(args.model, device=args.device, engine=engine)).start()
        started = time.perf_counter() - t0
        print(f"{design}: started in {started:.1f} s (warm-up {svc.warmup_s or 0:.1f} s), "
              f"{graphs() - before} graphs", file=sys.stderr, flush=True)
        mine = []
        try:
            asked = 0
            for n in bursts:
                first = burst(svc, n, asked, args.timeout)
                warm = burst(svc, n, asked + n, args.timeout)
                asked += 2 * n
                reserved = svc.device_reserved_bytes
                mine.append({"design": design, "burst": n, "first_s": first, "warm_s": warm,
                             "q_per_s_warm": n / warm, "graphs": graphs() - before, "start_s": started,
                             "warmup_s": svc.warmup_s, "reserved_mb": None if reserved is None else reserved / 2**20,
                             "model": args.model, "dtype": engine.dtype_name, "device": svc.device_name})
                print(f"{design}: burst {n}: first {first:.2f} s, warm {warm:.2f} s", file=sys.stderr, flush=True)
        finally:
            svc.stop()
            del engine, svc
        rows += mine
        if mine and not args.no_save:
            append_rows("gpu_serving", mine)  # as each design ends: a call cut short keeps the designs it finished
    if rows:
        print_table(rows, ["design", "burst", "first_s", "warm_s", "q_per_s_warm", "graphs", "start_s",
                           "reserved_mb"])


if __name__ == "__main__":
    main()
