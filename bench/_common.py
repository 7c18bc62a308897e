"""Shared helpers for the benchmarks: timing, machine description, CSV rows."""

from __future__ import annotations

import csv
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
SERVE_HINT = "pip install 'fastgate[serve,remote]'"  # the server the benches start, and httpx, their client


def require(module: str, hint: str) -> ModuleType:
    """``module`` imported (:func:`fastgate.errors.require`), or the bench ended with its one line naming it and how
    to install it (``hint``) instead of a traceback."""
    from fastgate.errors import MissingDependencyError
    from fastgate.errors import require as import_or_hint

    try:
        return import_or_hint(module, hint)
    except MissingDependencyError as exc:
        raise SystemExit(f"{Path(sys.argv[0]).name}: {exc}") from None


def results_dir() -> Path:
    """Where the CSVs go: ``$FASTGATE_BENCH_RESULTS`` when set (the GPU suite points it under ``$OUT``, whose files
    come back from a lent machine), else ``bench/results``."""
    return Path(os.environ.get("FASTGATE_BENCH_RESULTS") or RESULTS)


def median_time(fn: Callable[[], Any], repeat: int = 7, min_time: float = 0.05) -> float:
    """Median seconds per call over `repeat` rounds, each round looping until `min_time` has passed."""
    fn()  # warm-up
    samples = []
    for _ in range(repeat):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time:
                break
        samples.append(elapsed / n)
    return statistics.median(samples)


SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")  # machine()'s cpu_flags


def cpu_name() -> str:
    """The CPU's model name with its family and model numbers (a VM may say only "AMD EPYC": family 25 model 17 is a
    Zen 4, family 23 model 49 a Zen 2), else the platform's processor string."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model") and key not in fields:
                fields[key] = value.strip()
            if not line.strip() and fields:  # the first processor's block is enough
                break
    except OSError:
        pass
    name = fields.get("model name") or platform.processor() or platform.machine() or "unknown"
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name


def machine() -> dict[str, str]:
    import numpy
    import torch

    cpu = cpu_name()
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):  # the SIMD a kernel here may choose by: every row names them
                have = set(line.split(":", 1)[1].split())
                flags = " ".join(f for f in SIMD_FLAGS if f in have)
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    return {
        "timestamp": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu": cpu,
        "cpu_flags": flags,
        "cores": str(os.cpu_count()),
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "numpy": numpy.__version__,
    }


def append_rows(name: str, rows: list[dict[str, Any]]) -> Path:
    """Append rows (plus machine info) to bench/results/<name>.csv (:func:`results_dir`).

    Columns are the union over the file's rows and the new ones; when new columns appear the file is rewritten with
    the wider header (old rows get empty cells), so providers can be added to a benchmark over time.
    """
    out = results_dir()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.csv"
    info = machine()
    full = [{**r, **info} for r in rows]
    old: list[dict[str, str]] = []
    header: list[str] = []
    if path.exists():
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            old = list(reader)
    for r in full:
        header.extend(k for k in r if k not in header)
    append = bool(old) and all(k in old[0] for k in header)
    with open(path, "a" if append else "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, restval="")
        if not append:
            writer.writeheader()
            writer.writerows(old)
        writer.writerows(full)
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c, ""))) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c, "")).rjust(w) for c, w in zip(columns, widths)))


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def start_server(tree: Path, port: int, args: list[str], what: str = "the fastgate server") -> subprocess.Popen:
    """``fastgate serve --port PORT ... ARGS`` of checkout ``tree`` in a subprocess (loopback, quiet logs, a deep
    queue and long timeouts for load tests; ``tree`` prepended to the caller's ``PYTHONPATH``), once its ``/healthz``
    answers (at most 15 minutes: the model loads, and a first start builds the corpus's indexes: the dense one took
    ~5 minutes on a 2-core AVX2-only EPYC, where a 5-minute limit killed the server mid-build)."""
    path = os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH", "")) if p)  # the tree first
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}
    cmd = [sys.executable, "-m", "fastgate", "serve", "--port", str(port), "--max-queue", "1024", "--timeout", "600",
           "--log-level", "warning", *args]  # the caller's flags last: they override these
    return wait_healthy(subprocess.Popen(cmd, env=env, cwd=tree), f"http://127.0.0.1:{port}/healthz", 900, what)


def wait_healthy(proc: subprocess.Popen, url: str, seconds: float, what: str) -> subprocess.Popen:
    """``proc`` once ``url`` answers 200; killed, and the bench ended, if it exits first or ``seconds`` pass."""
    httpx = require("httpx", SERVE_HINT)

    deadline = time.time() + seconds
    while True:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise SystemExit(f"{what} did not start")
        time.sleep(0.5)
