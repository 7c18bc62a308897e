"""Latency under load of questions the gate skips beside questions that retrieve: does a cheap question stay cheap?

Starts ``fastgate serve --method dtr`` on a free loopback port (a subprocess, real model) and, with at most
``--max-seconds`` per scenario:

1. answers each candidate question alone and keeps the first ``--per-class`` the gate skips and the first that it
   sends to retrieval (their alone latencies are the reference);
2. ``burst``: sends the 2 × per-class questions at once; reports the skip and retrieve classes' p50 latency and the
   skip p50 over its alone p50;
3. ``late``: sends the retrieving questions, then one skip question ``--late`` seconds later, once per offset (0.25
   to 2 s by default, a different skip question each time); reports the median latency, its median ratio to the
   question alone and the worst. One arrival at one offset measured the phase it happened to hit (the retrieving
   questions' gate passes, their searches or their reading prompts' prefill), which moved a design's figure by 50%
   between runs;
4. ``sequential``: the same questions one by one, right after each round's burst; the burst's speedup is the median
   sequential wall time over the median burst wall time (``*_rounds``: every round's walls and ratio);
5. ``poisson``: an open loop: ``--poisson-requests`` questions (skip and retrieve alternating) arriving as a Poisson
   process (fixed seed) at each fraction in ``--poisson`` of the sustainable rate, taken as the first design's burst
   throughput (questions / burst wall time) so every design sees the same arrivals; reports p50/p95/p99 latency per
   class (``poisson50_skip_p95_s`` is the 95th percentile of skip questions at 50% of that rate; nearest rank: with
   the default 24 questions, 12 a class, p95 and p99 are both the slowest one).

With ``--baseline DIR`` (a checkout of another commit, e.g. ``git worktree add /tmp/old <commit>``) the same scenarios
run against a server started from that tree, in the same run, so the two designs are compared under the same
conditions (``--baseline-args`` passes that server's own flags); ``--variant NAME=FLAGS`` adds a server of this tree
with other flags (e.g. ``--variant "whole-prefill=--prefill-budget 0"``). Rows go to bench/results/mixed.csv, each
design's as soon as it is measured; a design whose server does not start is reported and skipped, and the run then
exits with status 1 after the others are measured and written (the first design measured sets the Poisson rate).

The questions go through one pooled client (``--client pooled``, kept-alive connections, as bench_serve's clients and
any real one); ``--client fresh`` builds a client per question as the runs before 2026-11-28 12:00 UTC did: httpx makes
an SSL context for each (~24 ms of CPU), so a burst of 12 spent ~290 ms of the load generator's CPU on the server's
two cores, and a burst's figures measured that as much as the server.

``--rounds N`` (3) measures the alone latencies, the burst, the sequential pass and the late arrivals N times and
reports each figure's median over rounds (``burst_skip_x_alone_rounds`` lists every round's ratio,
``sequential_wall_rounds_s`` / ``burst_wall_rounds_s`` every round's walls): one burst of 6-12 questions a class moved
a design's ratio by 30% between runs.

Run: python bench/bench_mixed.py [--per-class 8] [--rounds 3] [--poisson 0.5,0.8] [--variant NAME=FLAGS]
     [--baseline /tmp/old --baseline-args "--max-batch 32"]
"""

from __future__ import annotations

import argparse
import math
import random
import shlex
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SERVE_HINT, append_rows, print_table, require, start_server  # noqa: E402

CANDIDATES = [  # well-known facts (skipped by the calibrated gate) and corpus facts (retrieved), alternating
    "Who wrote Hamlet?", "What is the capital of Burkina Faso?", "What is the capital of France?",
    "What is the capital of Kyrgyzstan?", "What is the capital of Germany?", "What is the capital of Eritrea?",
    "What is the capital of Japan?", "What is the capital of Bhutan?", "What is the capital of Italy?",
    "What is the capital of Tuvalu?", "What is the capital of Spain?", "What is the capital of Suriname?",
    "Who painted the Mona Lisa?", "What is the capital of Djibouti?", "What is the capital of England?",
    "What is the capital of Lesotho?", "What is the capital of Russia?", "What is the capital of Vanuatu?",
    "What is the capital of China?", "What is the capital of Comoros?", "What is the capital of Egypt?",
    "What is the capital of Palau?", "Who discovered penicillin?", "What is the capital of Nauru?",
    "What is the capital of Canada?", "What is the capital of Kiribati?", "What is the capital of Greece?",
    "What is the capital of Malawi?", "What is the largest planet?", "What is the capital of Burundi?",
    "What is the capital of Poland?", "What is the capital of Tajikistan?",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(tree: Path, port: int, extra: list[str]) -> subprocess.Popen:
    return start_server(tree, port, ["--method", "dtr", *extra], f"the server from {tree}")


_CLIENT = None  # the pooled client of --client pooled (httpx.Client is thread-safe); None: a new one per request


def _ask(url: str, question: str) -> tuple[float, dict]:
    import httpx

    t0 = time.perf_counter()
    if _CLIENT is None:
        r = httpx.post(f"{url}/v1/answer", json={"question": question}, timeout=600)
    else:
        r = _CLIENT.post(f"{url}/v1/answer", json={"question": question})
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()


def _p50(v: list[float]) -> float:
    return statistics.median(v) if v else float("nan")


def _pct(v: list[float], q: float) -> float:
    """The q-quantile of ``v`` (nearest rank)."""
    if not v:
        return float("nan")
    s = sorted(v)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))]


def poisson(url: str, skip: list[str], retrieve: list[str], rate: float, n: int, max_seconds: float,
            seed: int = 0) -> dict[str, list[float]]:
    """Send ``n`` questions (skip / retrieve alternating) at Poisson arrivals of ``rate`` per second (stop sending
    after ``max_seconds``); the latencies per class."""
    rng = random.Random(seed)
    mixed = [q for pair in zip(skip, retrieve) for q in pair]
    t, plan = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        if t > max_seconds:
            break
        plan.append((t, mixed[i % len(mixed)], "skip" if i % 2 == 0 else "retrieve"))
    t0 = time.perf_counter()

    def one(item):
        at, q, cls = item
        time.sleep(max(0.0, at - (time.perf_counter() - t0)))
        return cls, _ask(url, q)[0]

    out: dict[str, list[float]] = {"skip": [], "retrieve": []}
    with ThreadPoolExecutor(max(1, len(plan))) as pool:
        for cls, took in pool.map(one, plan):
            out[cls].append(took)
    return out


def scenarios(url: str, per_class: int, max_seconds: float, fractions: list[float], n_poisson: int,
              rate: float | None, late_offsets: list[float], rounds: int = 1) -> dict:
    """Run the scenarios against the server at ``url``; the figures of one design (``rate``: the sustainable rate
    of the Poisson runs; None: this design's burst throughput). ``rounds``: the alone latencies, the burst, the
    sequential pass and the late arrivals that many times; each figure is the median over rounds (a burst's p50
    over 6-12 questions moved by 30% between runs of one design)."""
    _ask(url, CANDIDATES[-1])  # warm-up: lazy tables, prefix cache
    skip, retrieve, alone = [], [], {}
    t_end = time.perf_counter() + max_seconds
    for q in CANDIDATES:
        if (len(skip) >= per_class and len(retrieve) >= per_class) or time.perf_counter() > t_end:
            break
        took, rec = _ask(url, q)
        group = retrieve if rec["retrieved"] else skip
        if len(group) < per_class:
            group.append(q)
            alone[q] = took
    if not skip or not retrieve:
        raise SystemExit(f"found {len(skip)} skip and {len(retrieve)} retrieve questions; add candidates")
    mixed = [q for pair in zip(skip, retrieve) for q in pair]
    if rounds > 1:  # each question alone again: its median (the selection's answer is the first round)
        times = {q: [alone[q]] for q in mixed}
        for _ in range(rounds - 1):
            for q in mixed:
                times[q].append(_ask(url, q)[0])
        alone = {q: statistics.median(v) for q, v in times.items()}

    def burst(questions: list[str], delays: dict[str, float] | None = None) -> tuple[float, dict[str, float]]:
        t0 = time.perf_counter()

        def one(q: str) -> tuple[str, float]:
            time.sleep((delays or {}).get(q, 0.0))
            return q, _ask(url, q)[0]

        with ThreadPoolExecutor(len(questions)) as pool:
            out = dict(pool.map(one, questions))
        return time.perf_counter() - t0, out

    walls, seq_walls, skip_p50, retrieve_p50 = [], [], [], []
    for _ in range(rounds):  # each round: the burst, then the same questions one by one (drift falls on both)
        wall, lat = burst(mixed)
        walls.append(wall)
        skip_p50.append(_p50([lat[q] for q in skip]))
        retrieve_p50.append(_p50([lat[q] for q in retrieve]))
        t0 = time.perf_counter()
        for q in mixed:
            _ask(url, q)
        seq_walls.append(time.perf_counter() - t0)
    burst_wall, seq_wall = statistics.median(walls), statistics.median(seq_walls)
    late_s, late_x = [], []  # a skip question arriving while the retrieving ones run, at each offset
    for r in range(rounds):
        for i, offset in enumerate(late_offsets):
            late_q = skip[(i + r * len(late_offsets)) % len(skip)]
            _, late = burst(retrieve + [late_q], {late_q: offset})
            late_s.append(late[late_q])
            late_x.append(late[late_q] / alone[late_q])
    alone_skip = _p50([alone[q] for q in skip])
    rate = rate or len(mixed) / burst_wall
    open_loop = {"sustainable_qps": rate}
    for f in fractions:
        by_class = poisson(url, skip, retrieve, f * rate, n_poisson, max_seconds)
        tag = f"poisson{round(f * 100)}"
        for cls in ("skip", "retrieve"):
            for q in (0.5, 0.95, 0.99):
                open_loop[f"{tag}_{cls}_p{round(q * 100)}_s"] = _pct(by_class[cls], q)
    return {
        "skip": len(skip), "retrieve": len(retrieve), "rounds": rounds,
        "alone_skip_p50_s": alone_skip, "alone_retrieve_p50_s": _p50([alone[q] for q in retrieve]),
        "burst_skip_p50_s": _p50(skip_p50), "burst_retrieve_p50_s": _p50(retrieve_p50),
        "burst_skip_x_alone": _p50(skip_p50) / alone_skip,
        "burst_skip_x_alone_rounds": " ".join(f"{v / alone_skip:.2f}" for v in skip_p50),
        "late_skip_s": statistics.median(late_s), "late_skip_x_alone": statistics.median(late_x),
        "late_skip_max_s": max(late_s), "late_offsets": " ".join(f"{o:g}" for o in late_offsets),
        "burst_wall_s": burst_wall, "sequential_wall_s": seq_wall, "burst_speedup": seq_wall / burst_wall,
        "burst_wall_rounds_s": " ".join(f"{v:.2f}" for v in walls),
        "sequential_wall_rounds_s": " ".join(f"{v:.2f}" for v in seq_walls),
        "burst_speedup_rounds": " ".join(f"{s / b:.2f}" for s, b in zip(seq_walls, walls)),
        **open_loop,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--per-class", type=int, default=8, help="skip and retrieve questions each (default: 8)")
    ap.add_argument("--max-seconds", type=float, default=300, help="bound on the question selection per design")
    ap.add_argument("--baseline", default=None, help="a checkout of another commit to compare with, same run")
    ap.add_argument("--baseline-args", default="", help="extra `fastgate serve` flags for the baseline server")
    ap.add_argument("--args", default="", help="extra `fastgate serve` flags for this tree's server")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="another server of this tree with these flags (repeatable)")
    ap.add_argument("--poisson", default="0.5,0.8", help="open-loop arrival rates as fractions of the sustainable "
                    "rate, comma-separated; empty: none (default: 0.5,0.8)")
    ap.add_argument("--late", default="0.25,0.5,1,1.5,2", help="seconds after the retrieving questions that a skip "
                    "question arrives, one run each, comma-separated (default: %(default)s)")
    ap.add_argument("--poisson-requests", type=int, default=24, help="questions per open-loop rate (default: 24)")
    ap.add_argument("--client", choices=("pooled", "fresh"), default="pooled",
                    help="pooled: the questions share one client's kept-alive connections, as bench_serve's clients "
                    "do; fresh: a new client and connection per question (httpx builds an SSL context each time: "
                    "~24 ms of the load generator's CPU a question, on the server's cores; the runs before 2026-11-28 "
                    "12:00 UTC) (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=3, help="alone latencies, bursts, sequential passes and late "
                    "arrivals this many times, each figure the median over rounds (default: %(default)s)")
    args = ap.parse_args()
    require("httpx", SERVE_HINT)  # the client: ended with an install hint here, not a traceback later
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    fractions = [float(f) for f in args.poisson.split(",") if f.strip()]
    late_offsets = [float(o) for o in args.late.split(",") if o.strip()]
    if not late_offsets:
        ap.error("--late needs at least one offset")
    here = Path(__file__).resolve().parent.parent
    designs = [("scheduler", here, shlex.split(args.args))]
    for v in args.variant:
        name, _, flags = v.partition("=")
        designs.append((name, here, shlex.split(flags)))
    if args.baseline:
        designs.append(("baseline", Path(args.baseline).resolve(), shlex.split(args.baseline_args)))
    global _CLIENT
    if args.client == "pooled":
        import httpx

        # idle connections closed after 2 s, before uvicorn's 5 s: one reused as the server closes it would fail
        _CLIENT = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=None, max_keepalive_connections=256,
                                                                keepalive_expiry=2.0))
    rows = []
    failed = []  # the designs whose server did not start
    for name, tree, extra in designs:
        port = _free_port()
        try:
            proc = _start(tree, port, extra)
        except SystemExit as exc:  # reported; the other designs are measured all the same
            print(f"bench_mixed: design {name}: {exc}", file=sys.stderr)
            failed.append(name)
            continue
        try:
            commit = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True,
                                    text=True).stdout.strip()
            rate = rows[0]["sustainable_qps"] if rows else None  # every design sees the same arrivals
            rows.append({"design": name, "commit": commit, "flags": " ".join(extra), "client": args.client,
                         **scenarios(f"http://127.0.0.1:{port}", args.per_class, args.max_seconds, fractions,
                                     args.poisson_requests, rate, late_offsets, args.rounds)})
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        append_rows("mixed", rows[-1:])  # written as measured: a later design's failure loses none of it
        print_table(rows[-1:], list(rows[-1]))
    if not rows:
        sys.exit(f"bench_mixed: no design measured ({', '.join(failed)}: the server did not start)")
    print()
    print_table(rows, ["design", "alone_skip_p50_s", "burst_skip_p50_s", "burst_skip_x_alone", "late_skip_x_alone",
                       "burst_retrieve_p50_s", "burst_wall_s", "sequential_wall_s", "burst_speedup"])
    for f in fractions:
        tag = f"poisson{round(f * 100)}"
        print()
        print_table(rows, ["design", "sustainable_qps"] + [f"{tag}_{c}_p{q}_s" for c in ("skip", "retrieve")
                                                           for q in (50, 95, 99)])
    if failed:
        sys.exit(f"bench_mixed: the server of {', '.join(failed)} did not start: {len(rows)} design(s) written")


if __name__ == "__main__":
    main()
