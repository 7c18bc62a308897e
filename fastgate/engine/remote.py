"""A remote engine: generations sent to an OpenAI-compatible ``/v1/completions`` server (vLLM, SGLang, llama.cpp's
server, a hosted API, another ``fastgate serve``) with token log-probabilities asked for, mapped back to
:class:`~fastgate.engine.generation.Generation`.

What it offers the methods: the text of each generation and the log-probability of each generated token, which is
all that ``never``, ``always``, ``flare``, ``scaar`` and ``dtr`` read (DTR's answer NLL, FLARE's and SCAAR's word
probabilities; AIS and SCAAR's contributions are embedded locally with MiniLM). Methods that read hidden states
(``probing``, ``seakr``, ``cbdr``, and ``read``, whose gate is trained on a local model's signals) refuse to be built
on it (:attr:`RemoteEngine.black_box`, checked by :class:`~fastgate.methods.base.Method`).

How a generation maps back:

- ``text`` is the server's text (cut before the stop string, as the server does); ``token_logprobs`` the returned
  log-probabilities, one per returned token.
- ``token_ids`` are **not the server's vocabulary ids** (the completions API does not return them): each distinct
  token string (as bytes) gets an id of this engine's own, and :meth:`RemoteEngine.token_pieces` maps them back to
  the bytes, so word alignment (``ops.align_words``) runs on the returned token strings exactly as it
  runs on a local tokenizer's pieces. A token the server returns as ``bytes:\\xNN...`` (OpenAI's and vLLM's form of a
  partial UTF-8 character) or with a ``bytes`` list (chat format, llama.cpp) keeps its raw bytes.
- ``answer_tokens``: the leading tokens that start inside the text (a token that straddles the stop string counts,
  as in the local engine); the stop-string and EOS tokens a server returns after the text count as generated only.
- ``finish_reason``: ``length`` as the server says; otherwise ``stop`` with the stop string named by the server
  (vLLM's and fastgate's ``stop_reason``), or found at the start of the returned tokens after the text, else ``eos``
  (a server that neither names the stop string nor returns its token makes a stop look like an end of text: the
  sentence loop of FLARE / SCAAR then ends its rationale there).
- ``prompt_tokens`` is the server's ``usage.prompt_tokens``; ``truncated`` what a fastgate server reports (others
  refuse prompts longer than their context, and that question fails with their message).

Concurrency: :meth:`RemoteEngine.submit_each` sends the generations of one call as concurrent requests (at most
``concurrency`` at a time), each with a timeout and retries on 429 / 500 / 502-504 / a refused connection that wait what
``Retry-After`` says, and hands back one :class:`InFlight` per prompt, which the scheduler keeps across its ticks
until answered (:meth:`RemoteEngine.generate_each` waits for all): the scheduler fails only the questions whose
requests failed, and a slow one holds no other. The requests run on a small pool of daemon threads of this module's
own (:class:`_DaemonPool`) rather than ``concurrent.futures.ThreadPoolExecutor``, whose threads Python joins at
exit: an interrupted ``fastgate eval`` waited there for the requests in flight, up to ``--api-timeout``.
Sampling (``do_sample``) passes ``temperature``, ``top_p``, ``top_k`` (a vLLM / llama.cpp extension) and the seed
(sample j of a prompt seeded ``seed + j``); greedy generations send ``temperature: 0``. A server's sampler draws
differently from the local engine's, so only greedy generations are expected to match.
"""

from __future__ import annotations

import email.utils
import math
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field
from typing import Any

from fastgate.config import GenerationConfig, TapSpec
from fastgate.engine.generation import Generation, GenerationBatch, check_prompts
from fastgate.errors import InputError, RemoteError, require
from fastgate.settings import setting

__all__ = ["InFlight", "RemoteConfig", "RemoteEngine", "RemoteLM", "token_bytes"]


@dataclass(frozen=True)
class RemoteConfig:
    """Where and how a :class:`RemoteEngine` sends its generations."""

    # the flags of --engine openai are generated from these fields (fastgate.settings; fastgate.serving.engine_args)
    # the server's OpenAI base URL, with its /v1 (as the openai client takes it)
    base_url: str = setting(MISSING, "the server's OpenAI base URL, e.g. http://127.0.0.1:8000/v1")
    # the model name the server serves (vLLM: the HF name; fastgate serve: its LM's name); calibrations are keyed by it
    model: str = setting(MISSING, "the model name the server serves (fastgate serve: the name of its model, as "
                                  "/v1/models lists it); its calibration is looked up under this name",
                         flag="--api-model")
    api_key: str | None = field(default=None, repr=False)  # sent as a bearer token; the CLI reads it from the env
    # per request: a 48-token sentence takes well under a second on any GPU server
    timeout_s: float = setting(60.0, "seconds per request (default: %(default)s)", flag="--api-timeout")
    # requests in flight at once: enough to keep a server's batch full without flooding it
    concurrency: int = setting(8, "requests in flight at once (default: %(default)s)", flag="--api-concurrency")
    # on 429 / 500 / 502-504 / a refused connection: rides out a server restart or a short overload, then the question
    # fails (a 501 or 505 is not retried: the server cannot do it)
    max_retries: int = setting(3, "retries of a request answered 429, 500 or 502-504 or whose connection is refused "
                                  "(a server restarting), waiting what Retry-After says, else 0.5 s doubling "
                                  "(default: %(default)s)", flag="--api-retries")
    max_retry_wait_s: float = 30.0  # the longest Retry-After honoured; longer ones are waited this long
    logprobs: int = 1  # asked per token; 1, not 0: llama.cpp's server returns no log-probabilities for 0
    # the server's context as the question-length check assumes it (the server checks too): OpenAI's API does not say
    context_tokens: int = setting(4096, "the server's context in tokens, for the question-length check (default: "
                                        "%(default)s)", flag="--api-context")

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise InputError(f"--base-url must start with http:// or https://, got {self.base_url!r}")
        if not self.model:
            raise InputError("--api-model must name the model the server serves")
        if not self.timeout_s > 0:
            raise InputError(f"the API timeout must be > 0 s, got {self.timeout_s}")
        if self.concurrency < 1:
            raise InputError(f"the API concurrency must be >= 1, got {self.concurrency}")
        if self.max_retries < 0 or self.max_retry_wait_s < 0:
            raise InputError("API retries and retry wait must be >= 0")
        if not 1 <= self.logprobs <= 20:
            raise InputError(f"logprobs must be in 1..20, got {self.logprobs}")
        if self.context_tokens < 64:
            raise InputError(f"context_tokens must be >= 64, got {self.context_tokens}")

    @property
    def name(self) -> str:
        """What records name as the engine: ``openai:<base-url>:<model>``."""
        return f"openai:{self.base_url.rstrip('/')}:{self.model}"


@dataclass(frozen=True)
class RemoteLM:
    """What methods read of ``engine.lm`` (name, context), for a model behind an API."""

    name: str
    max_context: int
    fingerprint: str
    path: str | None = None
    n_layers: int = 0  # no hidden states reach this side
    hidden_size: int = 0


_HIDDEN_STATES = ("needs the model's hidden states, which an OpenAI-compatible server does not return")


def token_bytes(token: str, raw: Sequence[int] | None = None) -> bytes:
    """The bytes of one returned token: its ``bytes`` list where given, ``bytes:\\xNN...`` decoded (OpenAI's and
    vLLM's form of a token that is not whole UTF-8), else the string as UTF-8."""
    if raw is not None:
        return bytes(raw)
    if token.startswith("bytes:"):
        try:
            return token[6:].encode("latin-1").decode("unicode_escape").encode("latin-1")
        except (UnicodeError, ValueError):
            return token.encode("utf-8")
    return token.encode("utf-8")


class RemoteEngine:
    """The engine facade over an OpenAI-compatible server (see the module docstring); implements
    :class:`~fastgate.engine.protocol.ConcurrentEngine`.

    Offers what the methods and the scheduler call: :meth:`generate` (and :meth:`generate_each`, one result or error
    per prompt), :meth:`token_pieces`, :meth:`count_tokens`, :meth:`cache_prefix` (nothing to cache here), ``ops``
    and ``lm``. No hidden states: taps and :meth:`prompt_states` are refused.
    """

    remote = True  # the scheduler runs each tick's generations as one call of generate_each, no decode loop
    black_box = True  # methods reading hidden states refuse this engine (fastgate.methods.base.Method)
    dtype_name = None  # the server's weights are its own business
    n_layers = 0
    prefix_hits = 0

    def __init__(self, config: RemoteConfig, backend: str = "auto") -> None:
        from fastgate.ops.registry import build_ops

        self.config = config
        self.lm = RemoteLM(config.model, config.context_tokens, f"remote-{config.name}")
        self.ops = build_ops(backend, "cpu")  # word alignment, NLL and AIS run here, on the CPU
        self.backend = self.ops.backend
        self.device = None
        self.name = config.name
        self._url = config.base_url.rstrip("/") + "/completions"
        self._client = None
        self._pool = None
        self._lock = threading.Lock()
        self._ids: dict[bytes, int] = {}  # token bytes -> this engine's id (see the module docstring)
        self._pieces: list[bytes] = []
        self._checked = False
        self.requests = 0  # HTTP requests sent, retries included
        self.retries = 0
        self.http_s = 0.0  # seconds spent waiting on the server (summed over concurrent requests)
        self.server_s = 0.0  # of which the server reports working on them (fastgate servers report it)

    # ------------------------------------------------------------------ the facade's small parts
    def count_tokens(self, text: str) -> int:
        """An estimate (a quarter of the UTF-8 bytes): the server's tokenizer is not here. Used only to refuse
        absurdly long questions early; the server checks its own context."""
        return max(1, len(text.encode("utf-8")) // 4)

    def finish_warm_up(self) -> None:
        """Nothing: the server warms itself up."""

    def bind_thread(self) -> None:
        """Nothing: no device here."""

    def cache_prefix(self, text: str) -> int:
        """Nothing is cached on this side (servers with prefix caching do it themselves)."""
        return 0

    def token_pieces(self, token_ids: list[int]) -> list[bytes]:
        """The bytes of each returned token, from this engine's ids (see the module docstring)."""
        return [self._pieces[i] for i in token_ids]

    def prompt_states(self, prompts, layer=None, batch_size: int = 16):
        raise InputError(f"the remote engine {self.name} {_HIDDEN_STATES}")

    def close(self) -> None:
        """Close the HTTP client and the request threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._client is not None:
            self._client.close()
            self._client = None

    # ------------------------------------------------------------------ HTTP
    def _http(self):
        if self._client is None:
            httpx = require("httpx", "pip install httpx (or 'fastgate[remote]')")
            headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
            self._client = httpx.Client(timeout=httpx.Timeout(self.config.timeout_s), headers=headers,
                                        limits=httpx.Limits(max_connections=self.config.concurrency))
        return self._client

    def _post(self, body: dict[str, Any]) -> dict[str, Any]:
        """One completion, retried on 429, 500 and 502-504; raises :class:`RemoteError` with the reason."""
        httpx = require("httpx", "pip install httpx (or 'fastgate[remote]')")
        cfg = self.config
        client = self._http()
        for attempt in range(cfg.max_retries + 1):
            t0 = time.perf_counter()
            hung = RemoteError(f"{self.name}: no answer within {cfg.timeout_s:g} s (the server hangs or is "
                               "overloaded; --api-timeout sets the limit)")
            try:
                with self._lock:
                    self.requests += 1
                # streamed, so that the limit holds for the whole answer: httpx's timeout bounds each read, and a
                # server sending a byte now and then never reached it
                with client.stream("POST", self._url, json=body) as streamed:
                    data = bytearray()
                    for chunk in streamed.iter_bytes():
                        data += chunk
                        if time.perf_counter() - t0 > cfg.timeout_s:
                            raise hung
                    resp = httpx.Response(streamed.status_code, headers=streamed.headers, content=bytes(data))
            except httpx.TimeoutException:
                raise hung from None
            # a server restarting: as a 5xx (ReadError: the connection reset while its answer was read)
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
                if attempt < cfg.max_retries:
                    with self._lock:
                        self.retries += 1
                    time.sleep(_retry_wait(None, attempt, cfg.max_retry_wait_s))
                    continue
                raise RemoteError(f"{self.name}: cannot reach the server ({type(exc).__name__}: {exc}; "
                                  f"{attempt + 1} attempts)") from None
            except httpx.HTTPError as exc:
                raise RemoteError(f"{self.name}: cannot reach the server ({type(exc).__name__}: {exc})") from None
            finally:
                with self._lock:
                    self.http_s += time.perf_counter() - t0
            status = resp.status_code
            if status in _RETRIED:
                if attempt < cfg.max_retries:
                    with self._lock:
                        self.retries += 1
                    time.sleep(_retry_wait(resp.headers.get("retry-after"), attempt, cfg.max_retry_wait_s))
                    continue
                raise RemoteError(f"{self.name}: the server answered {status} "
                                  f"{'once' if attempt == 0 else f'{attempt + 1} times'}: {_message(resp)}")
            if status >= 500:  # 501, 505...: a server that cannot do this does not learn it by a retry
                raise RemoteError(f"{self.name}: the server failed the request ({status}): {_message(resp)}")
            if status >= 400:
                message = _message(resp)
                if "logprob" in message.lower():
                    raise RemoteError(self._no_logprobs(f"it refused them ({status}: {message})"))
                raise RemoteError(f"{self.name}: the server refused the request ({status}): {message}")
            try:
                return resp.json()
            except ValueError:
                raise RemoteError(f"{self.name}: the server's answer is not JSON: {resp.text[:200]!r}") from None
        raise AssertionError("unreachable")  # pragma: no cover

    def _no_logprobs(self, why: str) -> str:
        return (f"{self.name}: the server returns no token log-probabilities for /v1/completions ({why}); the "
                "remote engine needs them (vLLM, SGLang, llama.cpp's server and fastgate serve return them)")

    def connect(self) -> RemoteEngine:
        """Check once that the server answers a one-token completion with log-probabilities (else
        :class:`RemoteError` saying what is missing). Runs before the first generation if not called."""
        if not self._checked:
            out = self._post(self._body("Hello", GenerationConfig(max_new_tokens=1), None))
            self._parse(out, "Hello")
            self._checked = True
        return self

    # ------------------------------------------------------------------ generation
    def _body(self, prompt: str, cfg: GenerationConfig, seed: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.config.model, "prompt": prompt, "max_tokens": cfg.max_new_tokens,
                                "logprobs": self.config.logprobs, "n": 1, "stream": False}
        if cfg.do_sample:
            body.update(temperature=cfg.temperature, top_p=cfg.top_p)
            if cfg.top_k:
                body["top_k"] = cfg.top_k
            if seed is not None:
                body["seed"] = seed
        else:
            body["temperature"] = 0.0
        if cfg.stop:
            body["stop"] = list(cfg.stop)
        if not cfg.stop_at_eos:
            body["ignore_eos"] = True  # vLLM's extension
        return body

    def _parse(self, out: dict[str, Any], prompt: str, cfg: GenerationConfig | None = None) -> Generation:
        """A :class:`Generation` from one completion response (one choice); :class:`RemoteError` for an answer that
        does not have the format's types (tokens that are not strings, log-probs or usage that are not numbers)."""
        try:
            return self._parse_fields(out, prompt, cfg)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise RemoteError(f"{self.name}: the server's answer is malformed ({type(exc).__name__}: {exc}): "
                              f"{str(out)[:200]}") from None

    def _parse_fields(self, out: dict[str, Any], prompt: str, cfg: GenerationConfig | None) -> Generation:
        """:meth:`_parse`'s work: raises what a malformed field raises."""
        try:
            choice = out["choices"][0]
            text = choice.get("text") or ""
        except (KeyError, IndexError, TypeError, AttributeError):
            raise RemoteError(f"{self.name}: the answer has no choices[0].text: {str(out)[:200]}") from None
        lp = choice.get("logprobs")
        pieces, logps = _read_logprobs(lp)
        if pieces is None:
            raise RemoteError(self._no_logprobs(f"asked for logprobs={self.config.logprobs}, got "
                                                f"{str(lp)[:80] if lp is not None else 'none'}"))
        n_text = len(text.encode("utf-8"))
        covered = sum(len(p) for p in pieces)
        # the gates would read the confidence of part of the answer as the whole's. A U+FFFD in the text (3 bytes)
        # may stand for one byte of a token that split a character; and a server that stopped on a stop string may
        # drop the token that held it with the text before it (llama-server: Qwen's ".\n" is one token, " Paris."
        # comes with log-probs for " Paris"): up to one token's bytes short then
        short = 2 * text.count("\ufffd") + (_STOP_TOKEN_BYTES if choice.get("finish_reason") == "stop"
                                            and cfg is not None and cfg.stop else 0)
        if covered < n_text - short:
            raise RemoteError(f"{self.name}: the server returned log-probs for {covered} of the answer's {n_text} "
                              f"bytes ({len(pieces)} token(s) for {text[:60]!r})")
        bad = next((x for x in logps if not (math.isfinite(x) and x <= 1e-3)), None)
        if bad is not None:  # NaN made DTR's score NaN (never retrieving), -inf made it inf (always)
            raise RemoteError(f"{self.name}: the server returned a token log-prob of {bad}, not a log-probability")
        with self._lock:
            ids = [self._intern(p) for p in pieces]
        answer, start = 0, 0
        for p in pieces:
            if start < n_text:
                answer += 1
            start += len(p)
        stop_string, reason = None, "length" if choice.get("finish_reason") == "length" else "eos"
        if reason != "length" and cfg is not None and cfg.stop:
            named = choice.get("stop_reason")
            if isinstance(named, str) and named in cfg.stop:
                stop_string = named
            else:
                tail = b"".join(pieces)[n_text:].decode("utf-8", errors="replace")
                stop_string = next((s for s in cfg.stop if tail.startswith(s)), None)
            if stop_string is not None:
                reason = "stop"
        usage = out.get("usage") or {}
        ext = out.get("fastgate") if isinstance(out.get("fastgate"), dict) else {}
        if isinstance(ext.get("server_s"), (int, float)):  # a fastgate server says how long it worked on it
            self.server_s += float(ext["server_s"])
        return Generation(text=text, token_ids=ids, token_logprobs=logps, answer_tokens=answer,
                          finish_reason=reason, prompt_tokens=int(usage.get("prompt_tokens") or 0),
                          truncated=bool(ext.get("truncated", False)), stop_string=stop_string)

    def _intern(self, piece: bytes) -> int:
        i = self._ids.get(piece)
        if i is None:
            i = self._ids[piece] = len(self._pieces)
            self._pieces.append(piece)
        return i

    def submit_each(self, prompts: list[str], configs: Sequence[GenerationConfig | None],
                    taps: Sequence[TapSpec | None] | None = None, ks: Sequence[int] | None = None,
                    seeds: Sequence[int | None] | None = None) -> list[InFlight | BaseException]:
        """Put every prompt's k requests in flight (at most ``concurrency`` at a time) without waiting: one
        :class:`InFlight` per prompt, or the error that refused it at once (taps asked for; a server that fails the
        first connection check)."""
        n = len(prompts)
        taps = list(taps) if taps is not None else [None] * n
        ks = list(ks) if ks is not None else [1] * n
        seeds = list(seeds) if seeds is not None else [None] * n
        out: list[InFlight | BaseException | None] = [None] * n
        jobs: list[list[dict[str, Any]]] = [[] for _ in range(n)]  # each prompt's bodies, one a sample
        for i, (prompt, cfg) in enumerate(zip(prompts, configs)):
            cfg = cfg or GenerationConfig()
            t = taps[i]
            if t is not None and (t.layers or t.pre_answer or t.eos_state):
                out[i] = InputError(f"the remote engine {self.name} {_HIDDEN_STATES} (taps asked for)")
                continue
            if cfg.top_logprobs:  # its tokens are the server's text pieces, not ids of a vocabulary fastgate holds
                out[i] = InputError(f"the remote engine {self.name} gives no top_logprobs (each step's alternatives)")
                continue
            seed = seeds[i] if seeds[i] is not None else cfg.seed
            jobs[i] = [self._body(prompt, cfg, None if seed is None else seed + j) for j in range(ks[i])]
        if any(jobs) and not self._checked:
            try:
                self.connect()
            except RemoteError as exc:
                return [exc if o is None else o for o in out]
        if self._pool is None:
            self._pool = _DaemonPool(self.config.concurrency, "fastgate-remote")
        t0 = time.perf_counter()
        for i, bodies in enumerate(jobs):
            if out[i] is None:
                out[i] = InFlight(self, prompts[i], configs[i] or GenerationConfig(),
                                  [self._pool.submit(self._post, body) for body in bodies], t0)
        return out  # type: ignore[return-value]

    def generate_each(self, prompts: list[str], configs: Sequence[GenerationConfig | None],
                      taps: Sequence[TapSpec | None] | None = None, ks: Sequence[int] | None = None,
                      seeds: Sequence[int | None] | None = None) -> list[GenerationBatch | BaseException]:
        """One :class:`GenerationBatch` (k sequences) or one exception per prompt; every request of the call is in
        flight together (at most ``concurrency`` at a time), and the call returns once every one has ended."""
        return [h if isinstance(h, BaseException) else h.wait()
                for h in self.submit_each(prompts, configs, taps, ks, seeds)]

    def generate(self, prompts: list[str], config: GenerationConfig | Sequence[GenerationConfig] | None = None,
                 taps: TapSpec | Sequence[TapSpec | None] | None = None, k: int | Sequence[int] = 1,
                 seeds: Sequence[int | None] | None = None) -> GenerationBatch:
        """As :meth:`Engine.generate <fastgate.engine.local.Engine.generate>` (no taps): the first failed request's
        error is raised."""
        check_prompts(prompts)  # a string ran as one request per character
        n = len(prompts)
        if not (config is None or isinstance(config, (GenerationConfig, list, tuple))):
            raise InputError(f"generate: config must be a GenerationConfig or one per prompt, got "
                             f"{type(config).__name__}")
        if not isinstance(k, (int, list, tuple)) or isinstance(k, bool):
            raise InputError(f"k must be an int >= 1 or one per prompt, got {k!r}")
        configs = [config] * n if config is None or isinstance(config, GenerationConfig) else list(config)
        tap_list = [taps] * n if taps is None or isinstance(taps, TapSpec) else list(taps)
        ks = [k] * n if isinstance(k, int) else list(k)
        if len(configs) != n or len(tap_list) != n or len(ks) != n or (seeds is not None and len(seeds) != n):
            raise InputError(f"generate: configs, taps, sample counts and seeds must be one per prompt ({n})")
        if any(not isinstance(x, int) or x < 1 for x in ks):
            raise InputError(f"k must be >= 1, got {k}")
        parts = self.generate_each(prompts, configs, tap_list, ks, seeds)
        for part in parts:
            if isinstance(part, BaseException):
                raise part
        seqs = [s for part in parts for s in part.sequences]  # type: ignore[union-attr]
        return GenerationBatch(sequences=seqs, steps=max(part.steps for part in parts),  # type: ignore[union-attr]
                               timings=dict(parts[0].timings))  # type: ignore[union-attr]


class _DaemonPool:
    """``workers`` daemon threads running submitted calls in order, each call's :class:`concurrent.futures.Future`
    returned at once (the part of ``ThreadPoolExecutor`` the engine uses). Daemon threads: a process that exits does
    not wait for the requests they hold (see the module docstring)."""

    def __init__(self, workers: int, name: str) -> None:
        import queue

        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, fn, *args):
        from concurrent.futures import Future

        fut: Future = Future()
        self._jobs.put((fut, fn, args))
        return fut

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fut, fn, args = job
            if not fut.set_running_or_notify_cancel():  # cancelled while queued
                continue
            try:
                result = fn(*args)
            except BaseException as exc:  # noqa: BLE001 - the caller reads it from the future
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def shutdown(self, wait: bool = False, cancel_futures: bool = True) -> None:
        """Cancel the calls not started (``cancel_futures``) and end the threads once their calls return."""
        import queue

        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        if wait:
            for t in self._threads:
                t.join()


class InFlight:
    """One prompt's k requests in flight (:meth:`RemoteEngine.submit_each`): :meth:`done` once every one has ended,
    then :meth:`result`. The scheduler keeps it across ticks, so a slow request holds no other question."""

    def __init__(self, engine: RemoteEngine, prompt: str, config: GenerationConfig, futures: list, t0: float) -> None:
        self.engine, self.prompt, self.config, self.futures, self.t0 = engine, prompt, config, futures, t0

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def wait(self, timeout: float | None = None) -> GenerationBatch | BaseException:
        """:meth:`result` once every request has ended (at most ``timeout`` seconds: None if they have not)."""
        from concurrent.futures import wait

        wait(self.futures, timeout=timeout)
        return self.result() if self.done() else None  # type: ignore[return-value]

    def result(self) -> GenerationBatch | BaseException:
        """The k sequences, or the first request's failure (its own error: a timeout, a 5xx, a malformed answer)."""
        seqs = []
        for fut in self.futures:
            try:
                seqs.append(self.engine._parse(fut.result(), self.prompt, self.config))
            except Exception as exc:  # noqa: BLE001 - that prompt's own failure
                return exc
        elapsed = time.perf_counter() - self.t0
        return GenerationBatch(sequences=seqs, steps=max(len(s.token_ids) for s in seqs),
                               timings={"total_s": elapsed, "http_s": elapsed})

    def cancel(self) -> None:
        """Drop the requests not started yet (one already sent runs to its end: its answer is not read)."""
        for fut in self.futures:
            fut.cancel()


_STOP_TOKEN_BYTES = 16  # the most text a dropped stop-string token may carry before its stop string


def _read_logprobs(lp: Any) -> tuple[list[bytes] | None, list[float]]:
    """Token bytes and log-probabilities from a completion's ``logprobs``: OpenAI's completions format (``tokens``,
    ``token_logprobs``) or the chat format some servers also use for completions (``content``: ``token``,
    ``logprob``, ``bytes``). ``(None, [])`` when there are none."""
    if not isinstance(lp, dict):
        return None, []
    if isinstance(lp.get("content"), list):
        entries = lp["content"]
        try:
            pieces = [token_bytes(e.get("token") or "", e.get("bytes")) for e in entries]
            logps = [float(e["logprob"]) for e in entries]
        except (KeyError, TypeError, ValueError, AttributeError):
            return None, []
        return pieces, logps
    tokens, logps = lp.get("tokens"), lp.get("token_logprobs")
    if not isinstance(tokens, list) or not isinstance(logps, list) or len(tokens) != len(logps):
        return None, []
    if any(x is None for x in logps):
        return None, []
    return [token_bytes(t) for t in tokens], [float(x) for x in logps]


def _retry_wait(header: str | None, attempt: int, cap: float) -> float:
    """Seconds to wait before retrying: ``Retry-After`` (seconds or an HTTP date) where given, else 0.5 s doubling."""
    if header is not None:
        try:
            return min(cap, max(0.0, float(header)))
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(header)
            except (TypeError, ValueError):
                when = None
            if when is not None and when.tzinfo is not None:
                return min(cap, max(0.0, when.timestamp() - time.time()))
    return min(cap, 0.5 * 2 ** attempt)


# the statuses a request is retried on: overload (429, 503), a proxy's or server's passing failure (500, 502, 504)
_RETRIED = frozenset({429, 500, 502, 503, 504})


def _message(resp) -> str:
    """The error message of an OpenAI-style error body, else the start of the body."""
    try:
        body = resp.json()
    except ValueError:  # an HTML or text error page: its text on one line (an error is one line), tags dropped
        text = " ".join(re.sub(r"<[^>]*>", " ", resp.text).split())
        return text[:200] or "(an empty body)"
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict) and err.get("message"):
        return str(err["message"])[:300]
    if isinstance(err, str):
        return err[:300]
    if isinstance(body, dict) and body.get("detail"):
        return str(body["detail"])[:300]
    return str(body)[:200]
