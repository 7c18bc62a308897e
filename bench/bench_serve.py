"""Serving under load: throughput and latency of ``fastgate serve`` at 1, 4, 16 and 64 concurrent clients.

Starts ``fastgate serve`` on a free loopback port (a subprocess, real model), then for each concurrency level sends
``--requests`` questions from that many client threads (each waits for its answer before sending the next), bounded
by ``--max-seconds`` per level, through one pooled client (kept-alive connections, built before the level's clock
starts: until 2026-11-29 each thread built its own inside the window, ~21 ms of CPU each). Concurrency 1 is sequential
processing: the speedup column is throughput relative to it (to the first level where 1 is not among them). With
``--requests`` no more than the clients, a level is one burst (its figure includes the drain), not a closed loop:
give a few requests per client. Every request must get a 200 (a lost or failed request, a reset or a timeout too, is
counted and reported). Appends to bench/results/serve.csv.

With ``--ray --replicas N`` the same levels run twice on ``fastgate serve --ray`` (Ray Serve's HTTP proxy in front of
engine replicas, a local Ray): with 1 replica and with N, and ``speedup_vs_1_replica`` compares their throughput at
each level. On a 2-core CPU expect none: the replicas share the cores (each gets one: Ray sets its torch threads to
its CPUs), so the point there is that it runs and loses nothing; on a cluster each replica brings its own cores or GPU.
``mean_rows`` is left empty with Ray: ``/metrics`` is per replica.

Run: python bench/bench_serve.py [--method dtr] [--clients 1,4,16,64] [--requests 64] [--max-seconds 300]
     python bench/bench_serve.py --ray --replicas 2 --clients 1,8 --requests 16
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import SERVE_HINT, append_rows, print_table, require  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _percentile(v: list[float], q: float) -> float:
    v = sorted(v)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))] if v else float("nan")


def _batch_totals(url: str) -> tuple[float, float]:
    """(sequences, engine generation calls) so far, from the server's rows-per-call histogram."""
    import httpx

    values = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(("fastgate_generation_rows_sum", "fastgate_generation_rows_count")):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0]] = float(value)
    return values.get("fastgate_generation_rows_sum", 0.0), values.get("fastgate_generation_rows_count", 0.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--method", default="dtr")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--clients", default="1,4,16,64")
    ap.add_argument("--requests", type=int, default=64, help="requests per concurrency level")
    ap.add_argument("--max-seconds", type=float, default=300, help="stop sending new requests after this per level")
    ap.add_argument("--max-live", type=int, default=32, help="requests whose programs run at once")
    ap.add_argument("--ray", action="store_true", help="serve on Ray Serve: compare 1 replica with --replicas")
    ap.add_argument("--replicas", type=int, default=2, help="with --ray: the replicas compared with 1")
    ap.add_argument("--args", default="", help="extra `fastgate serve` flags (e.g. \"--prefill-budget 0\")")
    args = ap.parse_args()
    require("httpx", SERVE_HINT)  # the client: ended with an install hint here, not a traceback later

    from fastgate.eval.datasets import load_qa, sample_examples

    questions = [e.question for e in sample_examples(load_qa("heldout"), 256, seed=1)]
    rows = []
    for replicas in ([1, args.replicas] if args.ray else [None]):
        rows += _run_server(args, questions, replicas)
    if args.ray:
        single = {r["clients"]: r["qps"] for r in rows if r["replicas"] == 1}
        for r in rows:
            r["speedup_vs_1_replica"] = r["qps"] / single[r["clients"]] if single.get(r["clients"]) else float("nan")
    columns = ["clients", "answered", "failed", "qps", "speedup_vs_sequential", "p50_s", "p95_s", "mean_rows"]
    if args.ray:
        columns = ["replicas", *columns, "speedup_vs_1_replica"]
    print()
    print_table(rows, columns)
    print(f"appended to {append_rows('serve', rows)}")


def _run_server(args, questions: list[str], replicas: int | None) -> list[dict]:
    """Start a server (``replicas``: on Ray Serve with that many replicas), run every concurrency level, stop it."""
    import httpx

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "fastgate", "serve", "--method", args.method, "--model", args.model, "--port",
           str(port), "--max-live", str(args.max_live), "--max-queue", "1024", "--timeout", "600",
           "--log-level", "warning", *shlex.split(args.args)]
    if replicas is not None:
        cmd += ["--ray", "--replicas", str(replicas)]
    proc = subprocess.Popen(cmd, env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    rows = []
    try:
        deadline = time.time() + 600  # Ray starts, then every replica loads the model and the indexes
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        with httpx.Client(timeout=600) as client:  # warm-up: lazy tables, first batch (on every replica)
            for q in questions[-(replicas or 1):]:
                client.post(f"{url}/v1/answer", json={"question": q})
        base = None
        for c in [int(x) for x in args.clients.split(",")]:
            latencies: list[float] = []
            failures = 0
            lock = threading.Lock()
            q0, b0 = _batch_totals(url) if replicas is None else (0.0, 0.0)
            # one pooled client, built before the clock starts (a client per worker built inside the window spent
            # ~21 ms of CPU each, on the server's cores), its connections kept alive as any real client's
            pooled = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=c, max_keepalive_connections=c))
            t_start = time.perf_counter()
            stop_at = t_start + args.max_seconds
            counter = iter(range(args.requests))

            def worker(_: int) -> None:
                nonlocal failures
                for i in counter:
                    if time.perf_counter() > stop_at:
                        return
                    t0 = time.perf_counter()
                    try:
                        r = pooled.post(f"{url}/v1/answer", json={"question": questions[i % len(questions)]})
                        ok = r.status_code == 200
                    except httpx.HTTPError:  # a reset or a timeout is a lost request, counted, not a crashed level
                        ok = False
                    with lock:
                        if ok:
                            latencies.append(time.perf_counter() - t0)
                        else:
                            failures += 1

            with ThreadPoolExecutor(c) as pool:
                list(pool.map(worker, range(c)))
            wall = time.perf_counter() - t_start
            pooled.close()
            q1, b1 = _batch_totals(url) if replicas is None else (0.0, 0.0)
            qps = len(latencies) / wall
            base = qps if c == 1 or base is None else base  # "sequential": one client, where the run has it
            rows.append({"method": args.method, "model": args.model, "replicas": replicas or "",
                         "clients": c, "answered": len(latencies),
                         "failed": failures, "wall_s": wall, "qps": qps, "speedup_vs_sequential": qps / base,
                         "p50_s": statistics.median(latencies) if latencies else float("nan"),
                         "p95_s": _percentile(latencies, 0.95),
                         "mean_rows": (q1 - q0) / (b1 - b0) if b1 > b0 else float("nan"), "max_live": args.max_live,
                         "flags": args.args})
            print_table(rows[-1:], ["clients", "answered", "failed", "qps", "speedup_vs_sequential", "p50_s", "p95_s",
                                    "mean_rows"])
        metrics = httpx.get(f"{url}/metrics").text  # with Ray: one replica's
        print("\n".join(ln for ln in metrics.splitlines() if ln.startswith(("fastgate_requests_total",
                                                                             "fastgate_generation_rows_sum",
                                                                             "fastgate_generation_rows_count"))))
    finally:
        proc.terminate()  # the Ray server shuts Serve and its local Ray down on SIGTERM
        proc.wait(timeout=120)
    return rows


if __name__ == "__main__":
    main()
