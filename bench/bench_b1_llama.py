"""Batch-1 decode against llama.cpp with the two interleaved: each round times fastgate's packed step, then llama.cpp's
step on the same GGUF, at every context, so that a machine's drift (this project's shared 2-core VMs move ±30% within
minutes) falls on both alike. bench_engine.py times every fastgate design first and llama.cpp last, minutes apart.

Reports per context the median of each over the rounds and the median of the per-round ratios (fastgate / llama.cpp),
and each side's ``of_bound``: its read bound (the weights as it reads them and its keys and values, over the most
read bandwidth measured before the rounds: bench_engine.py's bound) over its median step; rows in
``bench/results/b1_llama.csv`` (a context's row written as soon as its last round is measured). llama.cpp runs in a
process of its own with its users' environment (bench/_llama_cpp.py).

Run: python bench/bench_b1_llama.py [--model smollm2-135m] [--dtype auto] [--weights auto] [--contexts 30,600]
[--rounds 7] [--steps 16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fastgate.entrypoints import passive_omp_threads  # noqa: E402

passive_omp_threads()  # as the fastgate command does, before torch loads (not for llama.cpp: _llama_cpp.py)
import torch  # noqa: E402
from _common import append_rows, cpu_name, print_table  # noqa: E402
from bench_engine import (  # noqa: E402
    bound_bandwidth,
    build_model,
    gguf_step_bytes,
    gguf_type,
    json_config,
    kv_bytes,
    llama_cpp_prompt,
    loop_step,
    open_llama_cpp,
    prompt_ids,
    read_bandwidth,
    weight_bytes,
)

from fastgate.engine.local import Engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--weights", default="auto")
    parser.add_argument("--contexts", default="30,600")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--no-save", action="store_true", help="print the rows only")
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    threads = torch.get_num_threads()
    llm, path, note = open_llama_cpp(args.model, max(contexts) + args.steps + 16, threads)
    if llm is None:
        sys.exit(f"llama.cpp: {note}")
    lm = build_model(args.model, "cpu", args.dtype, args.weights)
    engine = Engine(lm, prefix_cache=0, step="eager")
    ours = {c: prompt_ids(engine, 1, c) for c in contexts}
    theirs = {c: llama_cpp_prompt(llm, c) for c in contexts}
    times: dict[tuple[str, int], list[float]] = {}
    # each side's read bound: its weights as it reads them (fastgate: the C++ int4 kernel's plain codes where bound)
    # and its keys and values (both 16-bit), over the most bandwidth measured between rounds
    cfg = json_config(args.model)
    ours_bytes = weight_bytes(lm.model, 1, int4_plain=engine.runner.ops.backends["int4_matmul"] == "ext")
    theirs_bytes = gguf_step_bytes(path)  # its tensors less the gathered embedding table (not the file's size)
    rows = []

    def context_row(c: int) -> dict:  # context c's row, over its rounds
        bw = bound_bandwidth(torch.device("cpu"))  # measured before every round: the last round's is the most
        a, b = times[("fastgate", c)], times[("llama.cpp", c)]
        kv = kv_bytes(cfg, c + args.steps // 2 + 2)
        bound_a, bound_b = (ours_bytes + kv) / bw, (theirs_bytes + kv) / bw
        return {"context": c, "fastgate_ms": statistics.median(a) * 1e3,
                "llama_cpp_ms": statistics.median(b) * 1e3,
                "ratio": statistics.median(x / y for x, y in zip(a, b)),
                "ratio_min": min(x / y for x, y in zip(a, b)), "ratio_max": max(x / y for x, y in zip(a, b)),
                "fastgate_of_bound": bound_a / statistics.median(a),
                "llama_cpp_of_bound": bound_b / statistics.median(b), "read_GBps": bw / 1e9,
                "fastgate_weights_MB": ours_bytes / 1e6, "llama_cpp_weights_MB": theirs_bytes / 1e6,
                "rounds": len(a), "dtype": engine.dtype_name, "weights": lm.weights, "gguf": gguf_type(path),
                "llama_cpp": note, "threads": threads, "model": args.model, "cpu": cpu_name(),
                "cpu_capability": torch.backends.cpu.get_cpu_capability()}

    for rnd in range(args.rounds):
        read_bandwidth(torch.device("cpu"))  # before every round: the bound divides by the most measured
        for c in contexts:
            a = loop_step(engine, ours[c], args.steps, "packed")[0]
            b = llm.step(theirs[c], args.steps)[0]
            times.setdefault(("fastgate", c), []).append(a)
            times.setdefault(("llama.cpp", c), []).append(b)
            print(f"round {rnd} context {c}: fastgate {a * 1e3:.2f} ms, llama.cpp {b * 1e3:.2f} ms, {a / b:.2f}x",
                  file=sys.stderr)
            if rnd == args.rounds - 1:  # this context's rounds are done: its row is written now
                rows.append(context_row(c))
                if not args.no_save:
                    append_rows("b1_llama", rows[-1:])
    print_table(rows, ["context", "fastgate_ms", "llama_cpp_ms", "ratio", "ratio_min", "ratio_max", "fastgate_of_bound",
                       "llama_cpp_of_bound", "read_GBps", "dtype", "weights"])

if __name__ == "__main__":
    main()
