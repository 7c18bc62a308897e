"""One decode step of the engine's loop, against the machine's memory-bandwidth bound.

A decode step reads every weight once and every row's KV cache once; on a CPU (and at small batch on a GPU) nothing
else should bound it. This script decodes a batch of ``--batch`` rows whose prompts are ``--contexts`` tokens long
and reports the median step time for two KV-cache designs in one run:

- ``padded``: :class:`fastgate.decode.DecodeLoop` on :class:`fastgate.kv_cache.GrowingLayer` (appends in place
  into spare capacity);
- ``hf-dynamic``: the same loop on HF's ``DynamicCache`` (``torch.cat`` of the whole cache at every step: the design
  before the growing layer);
- ``packed``: :class:`fastgate.packed.PackedLoop` (the rows' tokens packed into one ``[1, M]`` forward, keys / values
  in fixed store rows written in place and read with a per-row length mask: the service's default layout).

Each row gives ``bound_ms`` = (weight bytes + KV bytes at that step) / the read bandwidth measured in the same run
(a ``sum`` over a buffer far larger than the caches, with the threads torch uses), ``of_bound`` = bound / step (1.0
means the step runs at the bandwidth limit), and ``vs_short`` = this step / the step of the shortest context for the
same design (the issue's target: at batch 16, 600-token contexts at most 1.5× 30-token ones). Rounds alternate
designs and contexts so drift hits all alike.

Run: python bench/bench_engine.py [--batch 16] [--contexts 30,600] [--steps 12] [--rounds 3].
Appends to bench/results/engine.csv.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from _common import append_rows, print_table  # noqa: E402

import fastgate.decode as decode  # noqa: E402
import fastgate.runner as runner  # noqa: E402
from fastgate.config import GenerationConfig, TapSpec  # noqa: E402
from fastgate.engine import Engine  # noqa: E402
from fastgate.models import load  # noqa: E402

FILLER = ("The river rises in the northern hills and flows south through farmland, past the old mill and the "
          "market town, before it reaches the sea at a wide estuary where ships once loaded wool and grain. ")


def read_bandwidth(mb: int = 1024, repeat: int = 5) -> float:
    """Bytes per second a ``sum`` reads from a buffer of ``mb`` MiB (median of ``repeat``)."""
    x = torch.ones(mb * 2**18, dtype=torch.float32)  # mb MiB
    x.sum()
    samples = []
    for _ in range(repeat):
        t = time.perf_counter()
        x.sum()
        samples.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(samples)


def hf_cache(config, max_cells=None):
    from transformers import DynamicCache

    return DynamicCache(config=config)


def cache_read(loop) -> tuple[int, int]:
    """The columns a step of ``loop`` attends and the KV bytes it reads: the padded cache whole, or for the packed
    store its rows × the widest row."""
    if hasattr(loop, "store"):
        width, store = max(loop.lens), loop.store
        return width, (2 * store.n_layers * len(loop.rows) * store.kv_heads * width * store.head_dim
                       * store.keys[0].element_size())
    return loop.mask.shape[1], sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in loop.cache.layers)


def step_time(engine: Engine, prompts: list[str], steps: int, design: str) -> tuple[float, int, int]:
    """Median seconds per decode step, the cache width and its bytes at the middle step."""
    from fastgate.packed import PackedLoop

    original = runner.new_cache  # the runner builds every padded loop's cache
    runner.new_cache = hf_cache if design == "hf-dynamic" else original
    try:
        cfg = GenerationConfig(max_new_tokens=steps + 8, stop_at_eos=False)  # every row decodes every step
        cls = PackedLoop if design == "packed" else decode.DecodeLoop
        loop = cls(engine, mid=engine.lm.n_layers // 2)
        with torch.inference_mode():
            loop.add([(p, cfg, TapSpec(), 1, None) for p in prompts])
            loop.step()  # the first token comes from the prefill's logits: warm-up
            times, width, kv = [], 0, 0
            for i in range(steps):
                t = time.perf_counter()
                loop.step()
                times.append(time.perf_counter() - t)
                if i == steps // 2:
                    width, kv = cache_read(loop)
        return statistics.median(times), width, kv
    finally:
        runner.new_cache = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--contexts", default="30,600", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    lm = load(args.model)
    engine = Engine(lm, prefix_cache=0)  # every row prefilled whole: the cache holds exactly the context
    contexts = [int(c) for c in args.contexts.split(",")]
    ids = engine.tokenizer(FILLER * (1 + max(contexts) // 30))["input_ids"]
    prompts = {c: [engine.tokenizer.decode(ids[i:i + c]) for i in range(args.batch)] for c in contexts}
    dtype = str(next(lm.model.parameters()).dtype).replace("torch.", "")
    weights = sum(p.numel() * p.element_size() for p in lm.model.parameters())
    designs = ["packed", "padded", "hf-dynamic"]
    times: dict[tuple[str, int], list[float]] = {(d, c): [] for d in designs for c in contexts}
    widths: dict[int, tuple[int, int]] = {}
    bandwidth = []
    for _ in range(args.rounds):
        bandwidth.append(read_bandwidth())
        for c in contexts:
            for d in designs:
                t, width, kv = step_time(engine, prompts[c], args.steps, d)
                times[(d, c)].append(t)
                widths[c] = (width, kv)
    bw = statistics.median(bandwidth)
    rows = []
    for d in designs:
        base = statistics.median(times[(d, contexts[0])])
        for c in contexts:
            step = statistics.median(times[(d, c)])
            width, kv = widths[c]
            bound = (weights + kv) / bw
            rows.append({"design": d, "batch": args.batch, "context": c, "cache_width": width,
                         "step_ms": step * 1e3, "bound_ms": bound * 1e3, "of_bound": bound / step,
                         "vs_short": step / base, "weights_MB": weights / 1e6, "kv_MB": kv / 1e6,
                         "read_GBps": bw / 1e9, "threads": torch.get_num_threads(), "model": args.model,
                         "device": str(lm.device), "dtype": dtype})
    print_table(rows, ["design", "batch", "context", "cache_width", "step_ms", "bound_ms", "of_bound", "vs_short",
                       "kv_MB", "read_GBps"])
    print(f"appended to {append_rows('engine', rows)}")


if __name__ == "__main__":
    main()
