"""llama.cpp as its users run it: llama-cpp-python in a child process, timed there, driven from a bench.

Why a process of its own: libgomp reads its wait policy once, when it loads, and torch's libgomp and the one
llama.cpp links share a soname, so in one process they are one runtime. The benches set ``OMP_WAIT_POLICY=PASSIVE``
before torch loads (as the ``fastgate`` command does: fastgate's C++ kernels need the cores torch's threads would
spin on); llama.cpp's ~30 parallel regions a token then sleep and wake between layers, and its batch-1 step ran
**2.8x slower** on a 2-core Zen 4 EPYC (22.7 ms against 7.9 with libgomp's default). Here llama.cpp gets the
environment its users give it: the parent's, without the policy the bench set for torch (a policy the user set
stays). Each step is timed in the child (``time.perf_counter`` around ``eval`` and the argmax of its logits), so the
pipe between the two costs nothing measured.

A batch of prompts is prefilled as llama.cpp's own server does it (``prefill_batch``): llama-cpp-python's low-level
API on a second context of the same loaded model, ``n_seq_max`` = the prompts, ``n_ctx`` = their tokens, and
llama-server's defaults otherwise (``-b 2048 -ub 512``, flash attention ``auto``, f16 KV cache, one KV stream per
sequence as with ``--parallel N``); the prompts' tokens fill ``llama_batch`` es of ``n_batch`` tokens in order, each
token tagged with its prompt's seq id and only each prompt's last token asking for logits, one ``llama_decode`` a batch
(llama.cpp splits it into ``n_ubatch`` micro-batches). The batches are filled before the clock starts (the server
fills them in C++; the bench's ctypes loop is not llama.cpp's cost); the KV cache is cleared
(``llama_memory_clear``) before every round, outside the timing.

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

    def prefill(self, ids: list[int]) -> tuple[float, int]:
        """Seconds of one prompt's evaluation (``Llama.eval``: one sequence) and its next token's argmax; the token."""
        t, tok = self._ask(cmd="prefill", ids=ids)
        return t, tok

    def prefill_batch(self, prompts: list[list[int]]) -> tuple[float, list[int], dict]:
        """Seconds to prefill ``prompts`` together, each its own sequence, in llama.cpp's batches (module docstring),
        and every prompt's next token (argmax); the context's settings (``n_batch``, ``n_ubatch``, ``n_ctx_seq``...)."""
        t, toks, info = self._ask(cmd="prefill_batch", prompts=prompts)
        return t, toks, info

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

    def prefill(ids: list[int]) -> list:
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        tok = next_token()
        return [time.perf_counter() - t, tok]

    batched: dict = {}  # the batched prefill's context and filled batches, for the last prompts asked

    def batch_setup(prompts: list[list[int]]) -> dict:
        key = json.dumps(prompts)
        if batched.get("key") == key:
            return batched
        if batched:  # other prompts: a context of their shape
            for b in batched["batches"]:
                llama_cpp.llama_batch_free(b)
            llama_cpp.llama_free(batched["ctx"])
            batched.clear()
        n_seq, longest = len(prompts), max(len(p) for p in prompts)
        params = llama_cpp.llama_context_default_params()  # llama-server's defaults but for the sizes below
        # one KV stream of n_ctx / n_seq_max cells a sequence (kv_unified off, as with --parallel N); llama.cpp pads a
        # stream to 256 cells
        params.n_ctx = n_seq * -(-(longest + 1) // 256) * 256
        params.n_batch, params.n_ubatch = 2048, 512  # llama-server's -b / -ub defaults
        params.n_seq_max = n_seq
        params.n_threads = params.n_threads_batch = threads
        ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
        if not ctx:
            raise RuntimeError(f"llama_init_from_model failed for {n_seq} sequences of {longest} tokens")
        if llama_cpp.llama_n_ctx_seq(ctx) < longest or llama_cpp.llama_n_seq_max(ctx) < n_seq:
            raise RuntimeError(f"the context holds {llama_cpp.llama_n_seq_max(ctx)} sequences of "
                               f"{llama_cpp.llama_n_ctx_seq(ctx)} tokens, not {n_seq} of {longest}")
        n_batch = llama_cpp.llama_n_batch(ctx)
        flat = [(s, p, tok, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, tok in enumerate(ids)]
        batches, outputs = [], []  # outputs[i]: (seq id, index in batch i) of the prompts ending in batch i
        for start in range(0, len(flat), n_batch):
            chunk = flat[start:start + n_batch]
            b = llama_cpp.llama_batch_init(n_batch, 0, 1)
            for i, (seq, pos, tok, last) in enumerate(chunk):
                b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, last
                b.seq_id[i][0] = seq
            b.n_tokens = len(chunk)
            batches.append(b)
            outputs.append([(seq, i) for i, (seq, _, _, last) in enumerate(chunk) if last])
        info = {"n_ctx": llama_cpp.llama_n_ctx(ctx), "n_ctx_seq": llama_cpp.llama_n_ctx_seq(ctx),
                "n_seq_max": llama_cpp.llama_n_seq_max(ctx), "n_batch": n_batch,
                "n_ubatch": llama_cpp.llama_n_ubatch(ctx), "decodes": len(batches)}
        batched.update(key=key, ctx=ctx, memory=llama_cpp.llama_get_memory(ctx), batches=batches, outputs=outputs,
                       info=info)
        return batched

    def prefill_batch(prompts: list[list[int]]) -> list:
        state = batch_setup(prompts)
        ctx, n_vocab = state["ctx"], llm.n_vocab()
        llama_cpp.llama_memory_clear(state["memory"], True)  # every round from an empty cache (untimed)
        toks = [0] * len(prompts)
        t = time.perf_counter()
        for b, outs in zip(state["batches"], state["outputs"]):
            rc = llama_cpp.llama_decode(ctx, b)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            for seq, i in outs:  # read before the next decode overwrites the logits
                logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ctx, i), shape=(n_vocab,))
                toks[seq] = int(np.argmax(logits))
        return [time.perf_counter() - t, toks, state["info"]]

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
            elif cmd["cmd"] == "prefill_batch":
                reply(ok=prefill_batch(cmd["prompts"]))
            else:
                reply(error=f"unknown command {cmd['cmd']!r}")
        except Exception as exc:  # noqa: BLE001  (told to the parent)
            reply(error=f"{type(exc).__name__}: {exc}")
    if batched:  # the batched context before the model it was made from (Llama frees the model at exit)
        for b in batched["batches"]:
            llama_cpp.llama_batch_free(b)
        llama_cpp.llama_free(batched["ctx"])


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
