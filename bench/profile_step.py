"""Where one eager decode step of the packed loop spends its time: a ``torch.profiler`` table of a few steps.

A diagnosis, not a benchmark: on a lent GPU the eager step took 50-90 ms for 30 layers though one kernel launch costs
~7 us, so something other than launches bounds it (host synchronisations, copies, Python). This prints the operators
by their own host time and by device time, and counts the synchronising calls (``aten::item``, device-to-host copies,
``cudaStreamSynchronize``), for ``--model`` (an embedded model or a random-weight shape of bench_engine.py).

torch.profiler does not record the C++ extension's pybind calls (fastgate's fused and quantised kernels), so the
tables may account for a small part of a step: beside them, a ``per step: profiled ops X ms of Y ms wall`` line says
how much of each profiled step's wall time (profiler overhead included) the operators hold.

``--prefill 16x700`` profiles a prefill instead: the serving path's packed passes (``PackedLoop.add``) and, beside
them, HF's one forward of the same batch (what bench_engine.py's prefill rows time), each operator's total.

Run: python bench/profile_step.py [--device cuda] [--model smollm2-135m-shape] [--batch 1] [--context 30]
[--steps 3] [--dtype bfloat16] [--rows 25] [--prefill ROWSxTOKENS]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from bench_engine import build_model, prompt_ids  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from fastgate.config import GenerationConfig, TapSpec  # noqa: E402
from fastgate.engine.local import Engine  # noqa: E402
from fastgate.engine.packed import PackedLoop  # noqa: E402

SYNCING = ("aten::item", "aten::_local_scalar_dense", "cudaStreamSynchronize", "cudaDeviceSynchronize",
           "cudaMemcpyAsync", "aten::nonzero", "aten::to", "aten::copy_", "aten::tolist")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-shape")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--weights", default="float",
                        help="float, int8, int4, int4-dense or auto (as --weights of fastgate)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=30)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=25, help="rows of each table")
    parser.add_argument("--prefill", default="", help="ROWSxTOKENS: profile a prefill (packed, then HF) instead")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = build_model(args.model, args.device, args.dtype, args.weights)
    engine = Engine(lm, prefix_cache=0, step="eager")
    cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if args.prefill:
        return profile_prefill(engine, args, cuda)
    prompts = [engine.tokenizer.decode(r) for r in prompt_ids(engine, args.batch, args.context)]
    cfg = GenerationConfig(max_new_tokens=args.steps + 12, stop_at_eos=False)
    loop = PackedLoop(engine.runner, mid=engine.n_layers // 2)
    with torch.inference_mode():
        loop.add([(p, cfg, TapSpec(), 1, None) for p in prompts])
        for _ in range(3):  # warm-up
            loop.step()
        sync()
        t = time.perf_counter()
        loop.step()
        sync()
        print(f"one step, not profiled: {(time.perf_counter() - t) * 1e3:.2f} ms (batch {args.batch}, context "
              f"{args.context}, {engine.dtype_name}, {engine.device})", flush=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            t = time.perf_counter()
            for _ in range(args.steps):
                loop.step()
            sync()
            wall = time.perf_counter() - t
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60), flush=True)
    print(coverage(events, wall, args.steps, "step"), flush=True)
    if cuda:
        print(events.table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60), flush=True)
    print("per step: calls that may synchronise or copy")
    for e in events:
        if e.key in SYNCING or "Memcpy" in e.key or "Synchronize" in e.key:
            ms = e.self_cpu_time_total / args.steps / 1e3
            print(f"  {e.key:40s} {e.count / args.steps:8.1f} calls  {ms:8.2f} ms")


def coverage(events, wall_s: float, n: int, what: str) -> str:
    """The host time the profiler attributed to operators (its tables' "Self CPU time total") beside the wall time,
    per ``what`` (``n`` of them profiled): torch.profiler does not record the C++ extension's pybind calls (the
    fused and quantised kernels), so a table may account for a small part of a step."""
    ops_ms = sum(e.self_cpu_time_total for e in events) / n / 1e3
    wall_ms = wall_s / n * 1e3
    return (f"per {what}: profiled ops {ops_ms:.2f} ms of {wall_ms:.2f} ms wall ({ops_ms / wall_ms:.0%}): the rest is "
            "in the C++ extension's calls, which torch.profiler does not record (and in Python between operators)")


def profile_prefill(engine, args, cuda: bool) -> None:
    """Profile the packed prefill of ``--prefill`` rows beside HF's one forward of the same batch (``prefill_time``
    synchronises the device itself)."""
    from bench_engine import prefill_time

    n, length = (int(x) for x in args.prefill.lower().split("x"))
    rows = prompt_ids(engine, n, length)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for design in ("packed", "hf-eager"):
        prefill_time(engine, rows, design)  # warm-up
        t = min(prefill_time(engine, rows, design) for _ in range(2))
        print(f"{design} prefill {n}x{length}: {t:.3f} s, {n * length / t:.0f} tok/s ({engine.dtype_name})", flush=True)
        with profile(activities=activities) as prof:
            wall = prefill_time(engine, rows, design)
        events = prof.key_averages()
        print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=60), flush=True)
        print(coverage(events, wall, 1, f"{design} prefill"), flush=True)
        if cuda:  # where the device's time goes, and how many kernels ran (a pass of many small ones is host-bound)
            print(events.table(sort_by="self_device_time_total", row_limit=args.rows, max_name_column_width=60),
                  flush=True)
            launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                                 "cudaLaunchKernelExC", "cudaMemcpyAsync",
                                                                 "cudaMemsetAsync"))
            print(f"{design}: {launches} kernel launches and copies", flush=True)


if __name__ == "__main__":
    main()
