"""What the gates' taps cost inside the decode loop of the default model.

One run decodes the same batch with no taps, with Probing-RAG's running sums (10 layers, accumulated every step) and
with running sums plus SeaKR's pre-answer/EOS states, and reports the decode-step time of each and the overhead
relative to no taps. Runs alternate (none, sums, all, none, …) so drift hits all three alike.

``step_ms`` / ``overhead_pct`` are per decode forward pass: what reading the taps and accumulating them adds to a step.
Taps also add forward passes: the last token's states need it fed once more (running sums), and SeaKR's EOS state
needs an EOS fed after that. ``forwards`` counts them, and ``per_token_overhead_pct`` is the whole decode time per
generated token against no taps, those extra passes included. On a noisy CPU the A/B difference of whole runs moves
by a few percent from run to run; ``taps_share_pct`` is the steadier figure: the time the loop spends reading the
hooks' outputs and accumulating them (host clock around that block), as a share of decode time.

Run: python bench/bench_taps.py [--batch 8] [--tokens 32] [--rounds 5]. Appends to bench/results/taps.csv.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_rows, print_table  # noqa: E402

from fastgate.assets.models import load  # noqa: E402
from fastgate.config import GenerationConfig, TapSpec  # noqa: E402
from fastgate.engine.local import Engine  # noqa: E402
from fastgate.methods.probing import default_probe_layers  # noqa: E402
from fastgate.prompts import closed_book_prompt  # noqa: E402

QUESTIONS = ["Who wrote Hamlet?", "What is the capital of Burkina Faso?", "What is the largest ocean?",
             "Who painted the Mona Lisa?", "In what year did the Berlin Wall fall?", "What is the capital of Chad?",
             "Who discovered penicillin?", "What is the boiling point of water?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="the weights' dtype")
    args = parser.parse_args()
    lm = load(args.model, dtype=args.dtype, weights="float")
    engine = Engine(lm)
    prompts = [closed_book_prompt(QUESTIONS[i % len(QUESTIONS)]) for i in range(args.batch)]
    cfg = GenerationConfig(max_new_tokens=args.tokens, stop_at_eos=False)  # every row decodes every step
    layers = default_probe_layers(lm.n_layers)
    variants = {"none": TapSpec(), "running_sums": TapSpec(layers=layers),
                "all_taps": TapSpec(layers=layers, pre_answer=True, eos_state=True)}
    engine.generate(prompts, cfg)  # warm-up
    per_step: dict[str, list[float]] = {k: [] for k in variants}
    per_token: dict[str, list[float]] = {k: [] for k in variants}
    share: dict[str, list[float]] = {k: [] for k in variants}
    forwards: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, taps in variants.items():
            batch = engine.generate(prompts, cfg, taps)
            per_step[name].append(batch.timings["decode_s"] / batch.forwards)
            per_token[name].append(batch.timings["decode_s"] / batch.steps)
            share[name].append(batch.timings["taps_s"] / batch.timings["decode_s"])
            forwards[name] = batch.forwards
    base = statistics.median(per_step["none"])
    base_token = statistics.median(per_token["none"])
    rows = []
    for name, times in per_step.items():
        t = statistics.median(times)
        rows.append({"op": "decode_step", "taps": name, "model": lm.name, "dtype": engine.dtype_name,
                     "backend": engine.backend,
                     "layers": len(layers) if name != "none" else 0, "B": args.batch, "tokens": args.tokens,
                     "step_ms": t * 1e3, "overhead_pct": (t / base - 1) * 100, "forwards": forwards[name],
                     "per_token_overhead_pct": (statistics.median(per_token[name]) / base_token - 1) * 100,
                     "taps_share_pct": statistics.median(share[name]) * 100})
    print_table(rows, ["taps", "layers", "B", "step_ms", "overhead_pct", "forwards", "per_token_overhead_pct",
                       "taps_share_pct"])
    print(f"appended to {append_rows('taps', rows)}")


if __name__ == "__main__":
    main()
