"""The remote engine: SCAAR, FLARE and DTR locally and through ``--engine openai`` pointed at a ``fastgate serve`` of
the same model on loopback (issue 38).

Starts ``fastgate serve --model M --dtype float32 --weights float`` on a free loopback port (a subprocess: its own copy
of the model, in the local runtime's dtype and weight format; the bench ends unless the server's ``/healthz`` names
both), answers the same questions with each method twice (in process on the local engine, then through a
:class:`~fastgate.engine.remote.RemoteEngine` whose requests the server answers as plain completions of its LM with
logprobs), and reports:

- ``identical_answers`` / ``identical_decisions``: the greedy answers, and every gate step's retrieve decision;
- ``max_dscore``: the largest gate-score difference; ``max_dlogprob``: the largest token log-prob difference over
  every generation the remote engine answered (each request the scheduler put in flight, recorded when its result
  was read), against the same prompt generated locally (same settings and seed), over those whose tokens are the
  same (``generations_compared``; ``generations_differing`` the others); NaN when none was compared;
- ``overhead_per_q_s``: (remote wall time − local wall time) / questions, the whole cost of the HTTP hop as a user
  sees it (both pipelines batch the questions: the remote one sends each scheduler tick's generations as concurrent
  requests, which the server batches again); ``hop_ms``: per request, the client's round trip minus the time the
  server reports working on it (``fastgate.server_s``): serialisation, HTTP and queueing.

If ``llama_cpp`` (llama-cpp-python) is importable, the same methods could also run against its server on the shipped
GGUF; that comparison is not implemented here yet, and the row says whether the package was found.

Appends one row per method to bench/results/remote.csv. Run from the repository root:

    python bench/bench_remote.py [--model smollm2-135m] [--data nq:test:balanced] [--n 8] [--methods scaar,flare,dtr]
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SERVE_HINT, append_rows, print_table, require, start_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DTYPE, WEIGHTS = "float32", "float"  # both sides: the local runtime and the server it is compared with


def _start(model: str, port: int, dtype: str, weights: str) -> subprocess.Popen:
    return start_server(ROOT, port, ["--model", model, "--method", "never", "--device", "cpu", "--dtype", dtype,
                                     "--weights", weights])


def _check_same_model(port: int, dtype: str | None, weights: str | None) -> None:
    """End the bench unless the server's ``/healthz`` names the local runtime's dtype and weight format: answers
    compared across different weights would differ for that alone."""
    import httpx

    health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).json()
    got = (health.get("dtype"), health.get("weights"))
    if got != (dtype, weights):
        raise SystemExit(f"bench_remote: the server runs dtype={got[0]} weights={got[1]}, the local runtime "
                         f"dtype={dtype} weights={weights}: not comparable")


class _Recorder:
    """Wraps a remote engine's ``submit_each`` (what the scheduler calls; the engine's own ``generate_each`` goes
    through it too) to keep every (prompt, config, seed, generation) it answered: each handle's first sequence is
    recorded when its result is read (``result()``, or ``wait()`` which reads it)."""

    def __init__(self, engine) -> None:
        self.engine, self.seen = engine, []
        inner = engine.submit_each

        def submit_each(prompts, configs, taps=None, ks=None, seeds=None):
            handles = inner(prompts, configs, taps, ks, seeds)
            for i, (p, c, h) in enumerate(zip(prompts, configs, handles)):
                if not isinstance(h, BaseException):
                    self._watch(h, p, c, None if seeds is None else seeds[i])
            return handles

        engine.submit_each = submit_each

    def _watch(self, handle, prompt, config, seed) -> None:
        inner, recorded = handle.result, []

        def result():
            out = inner()
            if not recorded and not isinstance(out, BaseException):  # a handle read twice is recorded once
                recorded.append(True)
                self.seen.append((prompt, config, seed, out.sequences[0]))
            return out

        handle.result = result  # the instance's own: wait() reads it through self.result()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--methods", default="scaar,flare,dtr")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="nq:test:balanced", help="questions (a benchmark spec or a JSONL file)")
    ap.add_argument("--n", type=int, default=8, help="questions per method")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8, help="the remote engine's requests in flight")
    args = ap.parse_args()
    require("httpx", SERVE_HINT)  # the remote engine's client and the server's /healthz check

    from fastgate.engine.remote import RemoteConfig
    from fastgate.eval.datasets import is_benchmark, load_benchmark, load_qa, parse_benchmark, sample_examples
    from fastgate.serving.runtime import Runtime, check_request
    from fastgate.testing import free_port

    if is_benchmark(args.data):
        examples = load_benchmark(parse_benchmark(args.data), seed=args.seed, n=args.n)
    else:
        examples = sample_examples(load_qa(args.data), args.n, args.seed)
    questions = [ex.question for ex in examples]
    try:
        import llama_cpp  # noqa: F401

        llama = "installed; not compared (not implemented)"
    except ImportError:
        llama = "not installed: skipped"
    print(f"llama-cpp-python: {llama}", file=sys.stderr)

    local = Runtime(args.model, device="cpu", dtype=DTYPE, weights=WEIGHTS)
    port = free_port()
    server = _start(args.model, port, DTYPE, WEIGHTS)
    rows = []
    try:
        _check_same_model(port, local.dtype_name, local.weights_name)
        url = f"http://127.0.0.1:{port}/v1"
        remote = Runtime(remote=RemoteConfig(url, local.lm.name, concurrency=args.concurrency, timeout_s=300))
        recorder = _Recorder(remote.engine)
        for name in [m.strip() for m in args.methods.split(",") if m.strip()]:
            request = check_request(name, {}, None, local.lm.name)
            answers = {}
            times = {}
            for label, runtime in (("local", local), ("remote", remote)):
                method = runtime.build(request)
                method.answer_batch(questions[:1])  # warm-up (prefix cache, embedder, connections)
                runtime.engine.finish_warm_up()
                eng = runtime.engine
                before = (getattr(eng, "http_s", 0.0), getattr(eng, "server_s", 0.0), getattr(eng, "requests", 0))
                recorder.seen.clear()
                t0 = time.perf_counter()
                answers[label] = method.answer_batch(questions)
                times[label] = time.perf_counter() - t0
                if label == "remote":
                    http_s = eng.http_s - before[0]
                    server_s = eng.server_s - before[1]
                    n_req = eng.requests - before[2]
                    seen = list(recorder.seen)
            a, b = answers["local"], answers["remote"]
            same_answers = sum(x.answer == y.answer for x, y in zip(a, b))
            same_decisions = sum([s.retrieve for s in x.gate_steps] == [s.retrieve for s in y.gate_steps]
                                 for x, y in zip(a, b))
            dscore = max((abs(s.score - t.score) for x, y in zip(a, b) for s, t in zip(x.gate_steps, y.gate_steps)),
                         default=0.0)
            # the generations the server answered, against the same prompts generated here
            ref = local.engine.generate([p for p, _, _, _ in seen], [c for _, c, _, _ in seen],
                                        seeds=[s for _, _, s, _ in seen]).sequences if seen else []
            dlp, unmatched = 0.0, 0
            for (_, _, _, got), want in zip(seen, ref):
                if remote.engine.token_pieces(got.token_ids) != local.engine.token_pieces(want.token_ids):
                    unmatched += 1
                    continue
                dlp = max([dlp, *(abs(u - v) for u, v in zip(got.token_logprobs, want.token_logprobs))])
            compared = len(seen) - unmatched
            if not compared:  # nothing compared: no difference to report, not a difference of 0
                dlp = math.nan
            rows.append({
                "method": name, "model": local.lm.name, "data": args.data, "n": len(questions),
                "local_s": times["local"], "remote_s": times["remote"],
                "overhead_per_q_s": (times["remote"] - times["local"]) / len(questions),
                "requests": n_req, "requests_per_q": n_req / len(questions),
                "hop_ms": 1000 * (http_s - server_s) / max(1, n_req),
                "identical_answers": f"{same_answers}/{len(questions)}",
                "identical_decisions": f"{same_decisions}/{len(questions)}",
                "max_dscore": dscore, "max_dlogprob": dlp, "generations_compared": compared,
                "generations_differing": unmatched, "concurrency": args.concurrency, "llama_cpp": llama,
                "dtype": local.dtype_name, "weights": local.weights_name,
            })
            print_table(rows[-1:], ["method", "local_s", "remote_s", "overhead_per_q_s", "requests_per_q", "hop_ms",
                                    "identical_answers", "identical_decisions", "max_dscore", "max_dlogprob",
                                    "generations_compared", "generations_differing"])
            if not compared:
                print(f"{name}: no generation compared ({len(seen)} recorded, {unmatched} with different tokens): "
                      "max_dlogprob is nan", file=sys.stderr)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    path = append_rows("remote", rows)
    print(f"appended {len(rows)} rows to {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
