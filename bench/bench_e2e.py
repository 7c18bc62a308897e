"""End to end: fastgate vs a reference pipeline of the same algorithm written the way the papers' code is.

For each method, on the same held-out questions (greedy decoding; SeaKR's samples use the same per-question seeds):
- ``fastgate``: the method on the engine (batched decode with taps summed on the fly, fused / C++ gate ops), the
  questions answered in batches of ``--batch-size``;
- ``reference``: the same method on :class:`fastgate.eval.baseline.ReferenceEngine`: one question, one prompt and one
  sample at a time through HF ``generate(output_hidden_states=True, output_logits=True,
  return_dict_in_generate=True)``, stop strings and hidden-state signals by post-processing (a second forward with
  ``output_hidden_states``), SeaKR's d×d-centring eigenscore, SCAAR's growing-window alignment and DTR's
  per-document AIS loop.

Both pipelines answer one question that no method times before the clock starts (the same warm-up on both sides);
then each is timed. Reports questions/s of both, the speedup, and how many answers are identical. Appends to
bench/results/e2e.csv.

Without a GPU both pipelines run the methods with ``fastgate eval``'s CPU budget (``fastgate.methods.calibration.
CPU_EVAL_BUDGET``: fewer SeaKR samples / steps / candidates, fewer CBDR candidates, one Probing-RAG round), since the
reference needs minutes per question otherwise; ``--budget full`` keeps the papers' counts.

Run: python bench/bench_e2e.py [--methods probing,dtr,seakr,cbdr,scaar] [--n 8] [--seakr-n 3] [--batch-size 16]
     [--budget auto|cpu|full]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_rows, print_table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="probing,dtr,seakr,cbdr,scaar")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="heldout")
    ap.add_argument("--n", type=int, default=8, help="questions per method")
    ap.add_argument("--seakr-n", type=int, default=3, help="questions for seakr (its reference samples one by one)")
    ap.add_argument("--budget", default="auto", choices=["auto", "cpu", "full"],
                    help="cpu: fastgate eval's CPU budget for both pipelines; auto: cpu without a GPU")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0, help="question order")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="the weights' dtype")
    args = ap.parse_args()

    from tqdm.auto import tqdm

    from fastgate.eval.baseline import ReferenceEngine, use_reference_ops
    from fastgate.eval.datasets import load_qa, sample_examples
    from fastgate.methods import build_method
    from fastgate.methods.calibration import CPU_EVAL_BUDGET
    from fastgate.serving.runtime import Runtime, check_request

    runtime = Runtime(args.model, dtype=args.dtype)
    ref_engine = ReferenceEngine(runtime.lm)
    timed = max(args.n, args.seakr_n)
    # one more question, timed by no method, warms both pipelines up (sample_examples: the first `timed` of this
    # draw are the questions a draw of `timed` gives)
    examples = sample_examples(load_qa(args.data), timed + 1, args.seed)
    warm_q = examples[timed].question if len(examples) > timed else examples[0].question
    budget = args.budget
    if budget == "auto":
        budget = "full" if torch.cuda.is_available() else "cpu"
    rows = []
    for name in [m.strip() for m in args.methods.split(",") if m.strip()]:
        params = dict(CPU_EVAL_BUDGET.get(name, {})) if budget == "cpu" else {}
        req = check_request(name, params, None, args.model)
        n = args.seakr_n if name == "seakr" else args.n
        questions = [e.question for e in examples[:n]]
        fast = runtime.build(req)
        ref = build_method(name, ref_engine, runtime.retriever(req.retriever) if req.retriever else None,
                           runtime.effective_params(req))
        use_reference_ops(ref)
        # warm-up, the same for both pipelines, outside the timing: one question neither times (a timed one could
        # leave its prompt in fastgate's prefix cache), for the lazy tables (token pieces, index pages), the
        # retriever's first search, torch's first-call costs
        fast.answer_batch([warm_q])
        fast.engine.finish_warm_up()  # what a batch's more rows would probe at their first products
        ref.answer(warm_q)
        t0 = time.perf_counter()
        fast_answers = []
        for s in range(0, n, args.batch_size):
            fast_answers += [r.answer for r in fast.answer_batch(questions[s:s + args.batch_size])]
        t_fast = time.perf_counter() - t0
        t0 = time.perf_counter()
        ref_answers = [ref.answer(q).answer for q in tqdm(questions, desc=f"{name} reference", leave=False)]
        t_ref = time.perf_counter() - t0
        same = sum(a == b for a, b in zip(fast_answers, ref_answers))
        for q, a, b in zip(questions, fast_answers, ref_answers):
            if a != b:
                print(f"  {name}: answers differ for {q!r}: fastgate {a!r}, reference {b!r}")
        rows.append({
            "method": name, "model": runtime.model_name, "n": n, "batch_size": args.batch_size,
            "params": ";".join(f"{k}={v}" for k, v in params.items()),
            "fastgate_s": t_fast, "reference_s": t_ref, "fastgate_qps": n / t_fast, "reference_qps": n / t_ref,
            "speedup": t_ref / t_fast, "identical": f"{same}/{n}", "device": str(runtime.lm.device),
            "dtype": runtime.dtype_name,
        })
        print_table(rows[-1:], ["method", "n", "fastgate_s", "reference_s", "speedup", "identical"])
    print()
    print_table(rows, ["method", "n", "fastgate_qps", "reference_qps", "speedup", "identical"])
    print(f"appended to {append_rows('e2e', rows)}")


if __name__ == "__main__":
    main()
