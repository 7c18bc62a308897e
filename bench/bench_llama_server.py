"""The same ``fastgate eval`` pipeline on the local engine and over llama.cpp's own ``llama-server`` (issue 45).

What a user would pick instead of fastgate's engine on a CPU is llama.cpp; fastgate can drive any OpenAI-compatible
server as its engine (``--engine openai``). This runs one ``fastgate eval`` invocation per engine on the same
questions and methods (default ``never,always,dtr`` on 24 balanced NQ test questions):

- ``local``: fastgate's own engine (``auto`` dtype, the packed loop, its batching);
- ``llama-server``: ``llama-server`` started here on loopback on the model's shipped GGUF (the 4-bit file fastgate
  converts its weights from), ``--parallel`` slots (continuous batching) and ``--threads`` threads, with fastgate's
  scheduler sending each tick's generations as concurrent requests (``--api-concurrency`` = the slots). The server is
  named as the model (``--alias``), so DTR's calibrated threshold is the same in both invocations.

Each engine's rows are appended to ``bench/results/pipeline.csv`` as soon as its invocation ends (a run cut short
keeps the first): accuracy, questions per second, seconds per question, and on llama-server's rows the local engine's
speed over it per run (``local_vs_llama_server``). ``llama-server`` is not installed by ``make install``: ``make
llama-server`` builds it from the llama.cpp source vendored in the pinned llama-cpp-python sdist (minutes on 2
cores), or pass ``--server``.

Run from the repository root:

    python bench/bench_llama_server.py [--model smollm2-135m] [--data nq] [--subset balanced] [--n 24]
        [--methods never,always,dtr] [--parallel 16] [--threads 2] [--server PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_rows, machine, print_table, wait_healthy  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BUILT = "build/bin/llama-server"  # `make llama-server` builds it under .cache/llama.cpp-<version>/


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_server(given: str | None) -> Path:
    """``--server``, ``$LLAMA_SERVER``, ``llama-server`` on the PATH, or ``make llama-server``'s build."""
    built = sorted((ROOT / ".cache").glob(f"llama.cpp-*/{BUILT}"), key=lambda p: p.stat().st_mtime)
    for candidate in (given, os.environ.get("LLAMA_SERVER"), shutil.which("llama-server"),
                      *(str(p) for p in reversed(built))):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return Path(candidate)
    raise SystemExit("llama-server not found: `make llama-server` builds it (llama.cpp vendored in the pinned "
                     "llama-cpp-python sdist), or pass --server PATH / set LLAMA_SERVER")


def start_llama_server(server: Path, gguf: Path, port: int, alias: str, parallel: int, threads: int,
                       context: int) -> subprocess.Popen:
    """``llama-server`` on loopback, once ``/health`` answers 200 (at most 2 minutes)."""
    cmd = [str(server), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", alias,
           "--parallel", str(parallel), "--threads", str(threads), "--ctx-size", str(context * parallel)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return wait_healthy(proc, f"http://127.0.0.1:{port}/health", 120, f"llama-server ({' '.join(cmd)})")


def run_eval(out: Path, args: argparse.Namespace, methods: str, extra: list[str]) -> dict:
    """One ``fastgate eval`` invocation of this checkout; its summary.json."""
    cmd = [sys.executable, "-m", "fastgate", "eval", "--model", args.model, "--data", args.data, "--subset",
           args.subset, "--n", str(args.n), "--method", methods, "--batch-size", str(args.batch_size), "--out",
           str(out), "--quiet", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run(cmd, check=True, cwd=ROOT, env=env)
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--data", default="nq")
    parser.add_argument("--subset", default="balanced")
    parser.add_argument("--n", type=int, default=24)
    parser.add_argument("--methods", default="never,always,dtr")
    parser.add_argument("--batch-size", type=int, default=16, help="questions in flight, both engines")
    parser.add_argument("--parallel", type=int, default=16, help="llama-server slots (and --api-concurrency)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama-server threads")
    parser.add_argument("--context", type=int, default=2048, help="llama-server context per slot")
    parser.add_argument("--server", default=None, help="the llama-server binary (default: see find_server)")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()

    from fastgate.assets.models import MODELS, locate_gguf

    server = find_server(args.server)
    gguf = locate_gguf(MODELS[args.model])
    info = {**machine(), "model": args.model, "data": f"{args.data}:{args.subset}", "n": args.n,
            "gguf": gguf.name, "parallel": args.parallel, "server_threads": args.threads,
            "batch_size": args.batch_size}
    rows: list[dict] = []

    def emit(engine: str, summary: dict) -> None:
        new = [{"engine": engine, "method": r["method"], "run": r["run"], "acc": r["acc"],
                "questions_per_s": r["questions_per_s"], "s_per_q": r["s_per_q"], "errors": r["errors"], **info}
               for r in summary["runs"]]
        local = {r["run"]: r for r in rows if r["engine"] == "local"}
        for r in new:  # on llama-server's rows: the local run's speed over it, the local rows being measured first
            if engine != "local" and r["run"] in local:
                r["local_vs_llama_server"] = local[r["run"]]["questions_per_s"] / r["questions_per_s"]
        rows.extend(new)
        if not args.no_save:
            append_rows("pipeline", new)  # now: a run cut short keeps what it measured

    with tempfile.TemporaryDirectory(prefix="fastgate-pipeline-") as tmp:
        emit("local", run_eval(Path(tmp) / "local", args, args.methods, []))
        port = free_port()
        proc = start_llama_server(server, gguf, port, args.model, args.parallel, args.threads, args.context)
        try:
            remote = run_eval(Path(tmp) / "remote", args, args.methods,
                              ["--engine", "openai", "--base-url", f"http://127.0.0.1:{port}/v1", "--api-model",
                               args.model, "--api-concurrency", str(args.parallel)])
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        emit("llama-server", remote)
    print_table(rows, ["engine", "method", "acc", "questions_per_s", "s_per_q", "errors", "local_vs_llama_server"])
    print(f"{info['cpu']}; llama-server {args.parallel} slots, {args.threads} threads, {gguf.name}")


if __name__ == "__main__":
    main()
