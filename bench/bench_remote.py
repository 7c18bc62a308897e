"""The remote engine: SCAAR, FLARE and DTR locally and through ``--engine openai`` pointed at a ``fastgate serve`` of
the same model on loopback (issue 38).

Starts ``fastgate serve --model M`` on a free loopback port (a subprocess: its own copy of the model), answers the
same questions with each method twice (in process on the local engine, then through a :class:`~fastgate.engine.remote.
RemoteEngine` whose requests the server answers as plain completions of its LM with logprobs), and reports:

- ``identical_answers`` / ``identical_decisions``: the greedy answers, and every gate step's retrieve decision;
- ``max_dscore``: the largest gate-score difference; ``max_dlogprob``: the largest token log-prob difference over
  every generation the remote engine received, against the same prompt generated locally (same settings);
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
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_rows, print_table, start_server  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def _start(model: str, port: int) -> subprocess.Popen:
    return start_server(ROOT, port, ["--model", model, "--method", "never", "--device", "cpu"])


class _Recorder:
    """Wraps a remote engine's ``generate_each`` to keep every (prompt, config, generation) it received."""

    def __init__(self, engine) -> None:
        self.engine, self.seen = engine, []
        inner = engine.generate_each

        def generate_each(prompts, configs, taps=None, ks=None, seeds=None):
            out = inner(prompts, configs, taps, ks, seeds)
            for p, c, o in zip(prompts, configs, out):
                if not isinstance(o, BaseException):
                    self.seen.append((p, c, o.sequences[0]))
            return out

        engine.generate_each = generate_each


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default="scaar,flare,dtr")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="nq:test:balanced", help="questions (a benchmark spec or a JSONL file)")
    ap.add_argument("--n", type=int, default=8, help="questions per method")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=8, help="the remote engine's requests in flight")
    args = ap.parse_args()

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

    local = Runtime(args.model, device="cpu", dtype="float32")
    port = free_port()
    server = _start(args.model, port)
    rows = []
    try:
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
            ref = local.engine.generate([p for p, _, _ in seen], [c for _, c, _ in seen]).sequences if seen else []
            dlp, unmatched = 0.0, 0
            for (_, _, got), want in zip(seen, ref):
                if remote.engine.token_pieces(got.token_ids) != local.engine.token_pieces(want.token_ids):
                    unmatched += 1
                    continue
                dlp = max([dlp, *(abs(u - v) for u, v in zip(got.token_logprobs, want.token_logprobs))])
            rows.append({
                "method": name, "model": local.lm.name, "data": args.data, "n": len(questions),
                "local_s": times["local"], "remote_s": times["remote"],
                "overhead_per_q_s": (times["remote"] - times["local"]) / len(questions),
                "requests": n_req, "requests_per_q": n_req / len(questions),
                "hop_ms": 1000 * (http_s - server_s) / max(1, n_req),
                "identical_answers": f"{same_answers}/{len(questions)}",
                "identical_decisions": f"{same_decisions}/{len(questions)}",
                "max_dscore": dscore, "max_dlogprob": dlp, "generations_compared": len(seen) - unmatched,
                "generations_differing": unmatched, "concurrency": args.concurrency, "llama_cpp": llama,
            })
            print_table(rows[-1:], ["method", "local_s", "remote_s", "overhead_per_q_s", "requests_per_q", "hop_ms",
                                    "identical_answers", "identical_decisions", "max_dscore", "max_dlogprob"])
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
