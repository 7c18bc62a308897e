"""llama.cpp as its users run it: llama-cpp-python in a child process, timed there, driven from a bench.

Why a process of its own: libgomp reads its wait policy once, when it loads, and torch's libgomp and the one
llama.cpp links share a soname, so in one process they are one runtime. The benches set ``OMP_WAIT_POLICY=PASSIVE``
before torch loads (as the ``fastgate`` command does: fastgate's C++ kernels need the cores torch's threads would
spin on); llama.cpp's ~30 parallel regions a token then sleep and wake between layers, and its batch-1 step ran
**2.8x slower** on a 2-core Zen 4 EPYC (22.7 ms against 7.9 with libgomp's default). Here llama.cpp gets the
environment its users give it: the parent's, without the policy the bench set for torch (a policy the user set
stays). Each step is timed in the child (``time.perf_counter`` around ``eval`` and the argmax of its logits), so the
pipe between the two costs nothing measured.

Protocol: one JSON object a line each way; the child answers ``{"ok": ...}`` or ``{"error": "..."}``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["LlamaCpp", "child_env"]


def child_env() -> dict[str, str]:
    """The environment llama.cpp's users give it: this one, less ``OMP_WAIT_POLICY`` where fastgate set it
    (:func:`fastgate.entrypoints.passive_omp_threads`; a policy the user set stays)."""
    from fastgate import entrypoints

    env = dict(os.environ)
    if entrypoints.OMP_POLICY_SET:
        env.pop("OMP_WAIT_POLICY", None)
    return env


class LlamaCpp:
    """A llama.cpp model on a GGUF in a child process (module docstring). ``version`` names llama-cpp-python."""

    def __init__(self, path: Path, n_ctx: int, threads: int, env: dict[str, str]) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), str(path), str(n_ctx), str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.version = self._read()

    def _read(self):
        line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp process ended (exit {self._proc.wait()})")
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"llama.cpp: {msg['error']}")
        return msg["ok"]

    def _ask(self, **cmd):
        self._proc.stdin.write(json.dumps(cmd) + "\n")
        self._proc.stdin.flush()
        return self._read()

    def tokenize(self, text: str) -> list[int]:
        return self._ask(cmd="tokenize", text=text)

    def step(self, ids: list[int], steps: int) -> tuple[float, int]:
        """Median seconds of one greedy decode step after ``ids`` and the context width at the middle step."""
        t, width = self._ask(cmd="step", ids=ids, steps=steps)
        return t, width

    def prefill(self, ids: list[int]) -> float:
        """Seconds of one prompt's evaluation and its next token's argmax."""
        return self._ask(cmd="prefill", ids=ids)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.stdin.close()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  (interpreter shutdown)
            pass


def _serve(path: str, n_ctx: int, threads: int) -> None:
    """The child: loads the model, answers commands until stdin closes."""
    import numpy as np

    def reply(**msg) -> None:
        sys.stdout.write(json.dumps(msg) + "\n")
        sys.stdout.flush()

    try:
        import llama_cpp

        llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                              n_gpu_layers=0, logits_all=False, verbose=False)
    except Exception as exc:  # noqa: BLE001  (told to the parent)
        reply(error=f"{type(exc).__name__}: {exc}")
        return

    def next_token() -> int:
        # the argmax of the last evaluated position's logits, read from llama.cpp's own buffer (llama-cpp-python 0.3.x
        # keeps no copy in llm.scores unless logits_all)
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))  # [V] float32, no copy
        return int(np.argmax(logits))

    def step(ids: list[int], steps: int) -> list:
        llm.reset()
        llm.eval(ids)
        tok = next_token()
        llm.eval([tok])  # warm-up step
        tok = next_token()
        times, width = [], 0
        for i in range(steps):
            t = time.perf_counter()
            llm.eval([tok])
            tok = next_token()
            times.append(time.perf_counter() - t)
            if i == steps // 2:
                width = llm.n_tokens
        return [statistics.median(times), width]

    def prefill(ids: list[int]) -> float:
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        next_token()
        return time.perf_counter() - t

    reply(ok=f"llama-cpp-python {llama_cpp.__version__}")
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            if cmd["cmd"] == "tokenize":
                reply(ok=llm.tokenize(cmd["text"].encode(), add_bos=False))
            elif cmd["cmd"] == "step":
                reply(ok=step(cmd["ids"], cmd["steps"]))
            elif cmd["cmd"] == "prefill":
                reply(ok=prefill(cmd["ids"]))
            else:
                reply(error=f"unknown command {cmd['cmd']!r}")
        except Exception as exc:  # noqa: BLE001  (told to the parent)
            reply(error=f"{type(exc).__name__}: {exc}")


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
