"""The engine's decode step and prefill by weight dtype, beside HF's own loop, against the memory-bandwidth bound.

A decode step reads every weight once and every row's KV cache once; on a CPU (and at small batch on a GPU) nothing
else should bound it. One run measures, for each dtype of ``--dtypes`` (``float32``, ``bfloat16``; ``auto`` resolves
as :func:`fastgate.assets.precision.choose_dtype` does at load), at every ``--batches`` × ``--contexts``:

- ``packed``: :class:`fastgate.engine.packed.PackedLoop` (the rows' tokens packed into one ``[1, M]`` forward, keys /
values
  in fixed store rows written in place: the service's layout);
- ``packed-hf``: the same loop with ``forward="hf"``: HF's module tree with hooks for the taps, where ``packed``
  runs the fused pass of :mod:`fastgate.engine.fused` (``auto`` picks it for Llama / Qwen2 / Mistral);
- ``padded``: :class:`fastgate.engine.decode.DecodeLoop` on :class:`fastgate.engine.kv_cache.GrowingLayer` (appends in
place);
- ``hf-dynamic``: the same loop on HF's ``DynamicCache`` (``torch.cat`` of the whole cache each step);
- ``hf-eager``: HF's forward in a bare greedy loop over a ``DynamicCache`` (no taps, no stop checks, no sampling
  settings): what the model itself costs a step;
- ``hf-static-compile`` (mode ``compiled``): HF's forward over a ``StaticCache``, compiled by ``torch.compile``
  (``fullgraph``; ``mode="reduce-overhead"``, CUDA graphs, on GPU). Compiling takes minutes on a small CPU: only the
  batches of ``--compile-batches``.

- ``packed-compiled`` (mode ``compiled``): the packed loop with the static step (:mod:`fastgate.engine.static_step`)
  as users get it (``StepConfig.sizes`` ``auto``: symbolic sizes): its decode-only passes as one function traced by
  ``torch.compile(fullgraph=True)``, two compiles in all (batch 1 is specialised; its first row compiles the graph of
  more rows, e.g. at batch 16), then on GPU a CUDA graph captured per bucket (vLLM's design), so its ``first_step_s``
  at a later batch or context is a capture, not a compile. ``packed`` is built with ``step="eager"`` (``auto`` would
  compile on CUDA), and every row's ``mode`` is what its loop actually ran; ``compiles`` counts the graphs dynamo
  built so far in the run.
- ``packed-compiled-bucket`` (mode ``compiled``): the same step with sizes fixed per (batch, width) bucket
  (``StepConfig(sizes="bucket")``): a compile per bucket (26-47 s each on an H200, a server's scheduler stalled
  meanwhile), left out on a CPU by default. It and ``hf-static-compile`` compile only at ``--compile-batches`` and
  ``--compile-contexts`` (one graph per batch and context).
- ``llama.cpp`` (mode ``native``): llama-cpp-python on the very GGUF file the embedded model is converted from (its
  own quantized blocks, ``dtype`` names the GGUF type), decode steps at batch 1 only (its ``Llama`` decodes one
  sequence), with as many threads as torch; the ``--prefill`` batch as the engine's rows (N different L-token prompts,
  decoded together through llama.cpp's batch API with a seq id each, llama-server's ``n_batch`` / ``n_ubatch``:
  bench/_llama_cpp.py) and a 1 × L prefill beside it, ``prefill_shape`` saying which. Skipped with an install hint
  (``make llama-cpp``) when ``llama_cpp`` is not importable, and for the random-weight shapes (no GGUF).

``--weights float,auto`` (the default) runs every design on each weight format (:mod:`fastgate.assets.quant`: ``int8``
holds the decoder blocks' linear weights and the LM head as int8 with one scale per output channel; ``int4`` in groups
of 32 with a scale and zero, an embedded model's own 4-bit GGUF blocks where it has them and int8 elsewhere;
``int4-dense`` adds a de-quantized copy for products beyond 4 rows; ``auto`` is what a user gets for the dtype on this
machine, skipped where it resolves to a form measured already); rows name the form as loaded. ``weights_MB`` counts
the bytes a step of its rows reads of the weights as held (int8 and its scales, int4's packed codes and its bf16
scales and zeros, or, for the packed design where the op ``int4_matmul`` is C++, the plain codes and float32 scales
and zeros it reads; int4-dense's copy beyond its kernel rows), which the bound reads.

A ``--prefill`` batch (``16x700``)
is timed too: ``packed`` is the serving path (:meth:`PackedLoop.add <fastgate.engine.packed.PackedLoop.add>`: packed
passes of the runner's ``prefill_chunk`` tokens through the fused pass, each prompt's first token included), ``engine``
:meth:`ModelRunner.prefill <fastgate.engine.model_runner.ModelRunner.prefill>` (the padded loop's: row chunks of
``prefill_chunk`` on CPU, HF's forward) and ``hf-eager`` one HF forward of the whole batch. The packed path starts
from text and tokenises it (timed, as a server does); ``tokenize_s`` is that part, timed again on its own, and
``vs_hf_ids`` the ratio without it (the others start from token ids).

Each step row gives ``bound_ms`` = (weight bytes + KV bytes at that step) / the read bandwidth measured in the same
run (a ``sum`` over a buffer far larger than the caches, before every round; the highest so far:
:func:`bound_bandwidth`), ``of_bound`` = bound / step (1.0: at the bandwidth limit) and ``vs_short`` = this step /
the shortest context's for the same design, dtype and batch. Every row names the CPU's bf16 flags (``bf16_flags``)
and what ``auto`` picks on this machine (``auto_dtype``). Rounds alternate designs and contexts so drift hits all
alike.

Run: python bench/bench_engine.py [--dtypes float32,bfloat16] [--weights float,auto] [--batches 1,16,64]
[--contexts 30,600] [--steps 12] [--rounds 3] [--prefill 16x700] [--designs ...] [--compile-batches 1,16,64]
[--compile-contexts 600] [--max-minutes 7] [--device cuda] [--model llama3-8b-shape].
Appends to bench/results/engine.csv (``$FASTGATE_BENCH_RESULTS`` when set), each row as soon as it is measured: its
last round, or its only sample.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fastgate.entrypoints import passive_omp_threads  # noqa: E402

passive_omp_threads()  # as the fastgate command does, before torch loads (not for llama.cpp: _llama_cpp.py)
import torch  # noqa: E402
from _common import append_rows, cpu_name, print_table  # noqa: E402

import fastgate.engine.model_runner as runner_module  # noqa: E402
from fastgate.assets.models import MODELS, LoadedModel, load, locate_gguf, resolve_device  # noqa: E402
from fastgate.assets.precision import choose_dtype, cpu_flags, native_bf16_flags  # noqa: E402
from fastgate.assets.quant import (  # noqa: E402
    WEIGHTS,
    Int4Linear,
    Int8Linear,
    canonical_weights,
    choose_weights,
    quantize_model,
)
from fastgate.config import GenerationConfig, TapSpec  # noqa: E402
from fastgate.engine.decode import DecodeLoop  # noqa: E402
from fastgate.engine.lm_head import DEFAULT_COLUMNS, slice_head  # noqa: E402
from fastgate.engine.local import Engine  # noqa: E402
from fastgate.engine.packed import PackedLoop  # noqa: E402
from fastgate.engine.static_step import StepConfig  # noqa: E402
from fastgate.ops.quant import INT4_HALF, int4_bf16_form  # noqa: E402

FILLER = ("The river rises in the northern hills and flows south through farmland, past the old mill and the "
          "market town, before it reaches the sea at a wide estuary where ships once loaded wool and grain. ")
DESIGNS = ("packed", "packed-hf", "packed-compiled", "packed-compiled-bucket", "padded", "hf-dynamic", "hf-eager",
           "hf-static-compile", "llama.cpp")
CPU_SKIPS = ("packed-compiled-bucket",)  # the default designs a CPU run leaves out (minutes of compiling a bucket)
PREFILL_FORMS = {"packed": "packed passes of the runner's prefill chunk (from text)", "engine": "row chunks",
                 "hf-eager": "one HF forward"}  # each prefill row's prefill_shape: what it timed
# the designs that compile a graph per batch and context (bounded by --compile-batches / --compile-contexts); the
# symbolic step (packed-compiled) compiles two graphs whatever the shapes (batch 1's and the rest's), so every shape
# runs it
COMPILED = ("packed-compiled-bucket", "hf-static-compile")
LLAMA_CPP_HINT = ("llama_cpp is not importable: `make llama-cpp` builds llama-cpp-python from source (or: pip install "
                  "--no-binary llama-cpp-python llama-cpp-python)")
SHAPES = {  # random weights in a model's shapes: timings without its weights (nothing to download or carry)
    "llama3-8b-shape": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                        "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                        "max_position_embeddings": 8192, "rope_theta": 500000.0, "tie_word_embeddings": False},
    "smollm2-135m-shape": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                           "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
                           "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": True},
}


BANDWIDTH: dict[str, list[float]] = {}  # device type -> every read_bandwidth measured in this run


def read_bandwidth(device: torch.device, mb: int = 1024, repeat: int = 5) -> float:
    """Bytes per second a ``sum`` reads from a buffer of ``mb`` MiB (median of ``repeat``), kept in
    :data:`BANDWIDTH`."""
    x = torch.ones(mb * 2**18, dtype=torch.float32, device=device)  # mb MiB
    sync = _sync(device)
    x.sum()
    samples = []
    for _ in range(repeat):
        sync()
        t = time.perf_counter()
        x.sum()
        sync()
        samples.append(time.perf_counter() - t)
    bw = x.numel() * 4 / statistics.median(samples)
    BANDWIDTH.setdefault(device.type, []).append(bw)
    return bw


def bound_bandwidth(device: torch.device) -> float:
    """The read bandwidth a bound divides by: the most measured so far in this run. A shared VM's measure moved
    between ~32 and ~61 GB/s within minutes (2-core Zen 4 EPYC, 2026-11-28); the machine's limit is the highest seen,
    and a median of the slow phases made a step look closer to its bound than it was."""
    return max(BANDWIDTH[device.type])

def _sync(device: torch.device) -> Callable[[], None]:
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def build_model(name: str, device: str, dtype: str, weights: str = "float") -> LoadedModel:
    """An embedded model or HF directory (``fastgate.assets.models.load``), or one of :data:`SHAPES`: random weights in
    that model's shapes (``llama3-8b-shape``: GQA 32/8 heads, 4096 wide, 128k vocabulary) with the tiny test
    tokenizer, built on the device (nothing to download or carry: for a lent GPU); ``weights`` as ``--weights``."""
    if name not in SHAPES:
        return load(name, device=device, dtype=dtype, weights=weights)
    from transformers import LlamaConfig, LlamaForCausalLM

    from fastgate.testing import _tokenizer

    dev = resolve_device(device)
    choice = choose_dtype(dtype, dev)
    tokenizer = _tokenizer(384)
    config = LlamaConfig(**SHAPES[name], bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    with dev:
        model = LlamaForCausalLM._from_config(config, dtype=choice.dtype).eval()
    held = choose_weights(weights, dev, choice.dtype, gguf_blocks=False)  # random weights: no GGUF blocks
    quantize_model(model, held.weights)
    return LoadedModel(name, model, tokenizer, None, name, choice.reason, weights=held.weights,
                       weights_reason=held.reason)


def weight_bytes(model, rows: int = 1, int4_plain: bool = False) -> int:
    """Bytes a decode step of ``rows`` rows reads of the weights as held: the parameters (tied ones once), the int8
    layers' weights and scales, the int4 layers' packed codes and bf16 scales and zeros (what torch's kernel reads;
    ``int4_plain``: their plain codes and float32 scales and zeros, the bytes the C++ kernel of op ``int4_matmul``
    reads, in its tiles; a bf16 model's kernel reads a Q4_1 file's float16 d and m instead, half the floats' bytes)
    or, beyond their kernel rows, their kept de-quantized copy (``int4-dense``), less the embedding table where the LM
    head does not multiply by it (an untied head, or a quantized head of its own: a step reads one row of the table a
    token)."""
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    bf16 = next(model.parameters()).dtype is torch.bfloat16  # the bf16 kernels read a Q4_1 file's d and m as float16
    for module in model.modules():
        kept = module.kept_dtype if isinstance(module, (Int8Linear, Int4Linear)) else None
        if kept is not None and rows > module.kernel_rows:
            # the de-quantized copy the product reads: plain, or held by the dense op that took it over at its first
            # product (then module.dense is None, and counting the codes undercounted a batch step 2.8x)
            held += module.out_features * module.in_features * torch.empty((), dtype=kept).element_size()
        elif isinstance(module, Int8Linear):
            held += sum(t.numel() * t.element_size() for t in (module.q, module.scale))
        elif isinstance(module, Int4Linear):
            read = (module.q, module.scale, module.zero) if int4_plain else (module.packed, module.scale_zeros)
            floats = sum(t.numel() * t.element_size() for t in read[1:])
            if int4_plain and bf16 and int4_bf16_form(module.scale, module.zero) == INT4_HALF:
                floats //= 2
            held += read[0].numel() * read[0].element_size() + floats
    embed = model.get_input_embeddings().weight
    head = getattr(model.get_output_embeddings(), "weight", None)
    return held - (embed.numel() * embed.element_size() if head is not embed else 0)


def compiles() -> int:
    """Graphs dynamo has compiled in this process (the suite's compile budget)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def open_llama_cpp(model: str, n_ctx: int, threads: int):
    """``(LlamaCpp, gguf path, note)`` for the llama.cpp design, in a process of its own with the environment its users
    give it (bench/_llama_cpp.py: in this one torch's OpenMP policy would be its too); ``(None, None, why)`` where it
    cannot run."""
    import importlib.util

    from _llama_cpp import LlamaCpp, child_env

    if importlib.util.find_spec("llama_cpp") is None:
        return None, None, LLAMA_CPP_HINT
    if model not in MODELS:
        return None, None, f"{model} has no GGUF file (random weights in a model's shapes)"
    path = locate_gguf(MODELS[model])
    env = child_env()
    llm = LlamaCpp(path, n_ctx, threads, env)
    policy = env.get("OMP_WAIT_POLICY", "libgomp's default")
    return llm, path, f"{llm.version}, own process, OMP_WAIT_POLICY {policy}"


def gguf_type(path: Path) -> str:
    """The quantization a GGUF's name gives (``Q4_1``, ``Q4_K_M``), else ``gguf``."""
    m = re.search(r"(?i)[._-]((?:I?Q\d[\w]*?)|BF16|F16|F32)(?:\.gguf|$)", path.name)
    return m.group(1).upper() if m else "gguf"


def gguf_step_bytes(path: Path) -> int:
    """Bytes of a GGUF's tensors that a decode step reads: every tensor but the token embedding table, which a step
    gathers one row of a token (unless it is also the LM head: no ``output.weight``). The file's size counted its
    metadata and the whole table too (qwen2.5-0.5b: 491 MB against the 392 MB a step reads)."""
    from fastgate.assets.gguf_tensors import read_gguf_tensors

    tensors = {t.name: t.n_bytes for t in read_gguf_tensors(path)}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")


def llama_cpp_prompt(llm, context: int) -> list[int]:
    ids = llm.tokenize(FILLER * (2 + context // 20))
    return ids[:context]


def kv_bytes(cfg: dict[str, int], width: int, element: int = 2) -> int:
    """Bytes of keys and values one sequence of ``width`` columns holds (``cfg``: :func:`json_config`), 16-bit by
    default (llama.cpp's f16 cache, fastgate's bf16 store)."""
    return 2 * cfg["layers"] * cfg["kv_heads"] * cfg["head_dim"] * width * element


def prompt_ids(engine: Engine, batch: int, context: int) -> list[list[int]]:
    """``batch`` different windows of ``context`` filler tokens."""
    ids = engine.tokenizer(FILLER * (2 + (context + batch) // 20))["input_ids"]
    return [ids[i:i + context] for i in range(batch)]


def cache_read(loop) -> tuple[int, int]:
    """The columns a step of ``loop`` attends and the KV bytes it reads: the padded cache whole, or for the packed
    store its rows × the widest row."""
    if hasattr(loop, "store"):
        width, store = max(loop.lens), loop.store
        return width, (2 * store.n_layers * len(loop.rows) * store.kv_heads * width * store.head_dim
                       * store.keys[0].element_size())
    return loop.mask.shape[1], sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in loop.cache.layers)


def _hf_cache(config, max_cells=None):
    from transformers import DynamicCache

    return DynamicCache(config=config)


FIRST_STEP: dict[tuple[str, int, int], float] = {}  # (design, batch, context) -> slowest first step (compiles)


def loop_step(engine: Engine, rows: list[list[int]], steps: int, design: str) -> tuple[float, int, int]:
    """Median seconds per decode step of the engine's loop, the cache width and its bytes at the middle step."""
    original = runner_module.new_cache  # the runner builds every padded loop's cache
    runner_module.new_cache = _hf_cache if design == "hf-dynamic" else original
    sync = _sync(torch.device(engine.device))
    prompts = [engine.tokenizer.decode(r) for r in rows]
    try:
        cfg = GenerationConfig(max_new_tokens=steps + 8, stop_at_eos=False)  # every row decodes every step
        cls = PackedLoop if design.startswith("packed") else DecodeLoop
        loop = cls(engine.runner, mid=engine.n_layers // 2)
        with torch.inference_mode():
            loop.add([(p, cfg, TapSpec(), 1, None) for p in prompts])
            t0 = time.perf_counter()
            loop.step()  # the first token comes from the prefill's logits: warm-up (and a compiled bucket's compile)
            sync()
            FIRST_STEP[(design, len(rows), len(rows[0]))] = max(FIRST_STEP.get((design, len(rows), len(rows[0])), 0.0),
                                                                time.perf_counter() - t0)
            times, width, kv = [], 0, 0
            for i in range(steps):
                sync()
                t = time.perf_counter()
                loop.step()
                sync()
                times.append(time.perf_counter() - t)
                if i == steps // 2:
                    width, kv = cache_read(loop)
        return statistics.median(times), width, kv
    finally:
        runner_module.new_cache = original


@contextlib.contextmanager
def plain_head(engine: Engine) -> Iterator[None]:
    """HF's own LM head for the HF designs (the engine slices a float32 CPU model's head, and the slices' per-shape
    check is no graph torch.compile can take whole); the engine's head back after."""
    slice_head(engine.model, 0)
    try:
        yield
    finally:
        if engine.sliced_head:
            slice_head(engine.model, DEFAULT_COLUMNS)


def hf_eager_step(engine: Engine, rows: list[list[int]], steps: int) -> tuple[float, int, int]:
    """HF's forward in a bare greedy loop over a ``DynamicCache``: median seconds a step, width and KV bytes."""
    from transformers import DynamicCache

    model, dev = engine.model, engine.device
    sync = _sync(torch.device(dev))
    ids = torch.tensor(rows, device=dev)  # [B, C], every row the same length
    cache = DynamicCache(config=model.config)
    kw = engine.runner.cache_kw  # the name this transformers gives forward's KV cache argument
    with torch.inference_mode():
        nxt = model(input_ids=ids, **{kw: cache}, use_cache=True, logits_to_keep=1).logits[:, -1].argmax(-1)  # [B]
        times, width, kv = [], 0, 0
        for i in range(steps):
            sync()
            t = time.perf_counter()
            out = model(input_ids=nxt[:, None], **{kw: cache}, use_cache=True)  # [B, 1] -> logits [B, 1, V]
            nxt = out.logits[:, -1].argmax(-1)  # [B]
            sync()
            times.append(time.perf_counter() - t)
            if i == steps // 2:
                width = cache.get_seq_length()
                kv = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)
    return statistics.median(times), width, kv


def step_mode(engine: Engine) -> str:
    """How the engine's decode steps ran: ``compiled``, ``eager``, or ``eager-fallback`` where a bucket's compile
    failed and the static step went on eagerly (its warning says why): a row must not call that compiled."""
    runner = engine.runner
    if not runner.compiled:
        return "eager"
    return ("compiled" if all(s.compiled and not s.eager_buckets for s in runner._static.values())
            else "eager-fallback")


def hf_static_compile_step(engine: Engine, rows: list[list[int]], steps: int) -> tuple[float, int, int]:
    """HF's forward over a ``StaticCache``, the decode step compiled (``fullgraph``; CUDA graphs on GPU); the
    compile happens in the first steps, which are not timed."""
    from transformers import StaticCache

    model, dev = engine.model, torch.device(engine.device)
    sync = _sync(dev)
    b, c = len(rows), len(rows[0])
    total = c + steps + 4
    cache = StaticCache(config=model.config, max_cache_len=total)
    ids = torch.tensor(rows, device=dev)  # [B, C]
    mode = "reduce-overhead" if dev.type == "cuda" else None
    step = torch.compile(model.forward, fullgraph=True, mode=mode)
    kw = engine.runner.cache_kw
    with torch.inference_mode():
        pos = torch.arange(c, device=dev)  # [C]
        out = model(input_ids=ids, **{kw: cache}, cache_position=pos, use_cache=True, logits_to_keep=1)
        nxt = out.logits[:, -1].argmax(-1)  # [B]
        times = []
        for i in range(steps + 3):  # 3 warm-up steps: compile, then (CUDA) record the graph
            where = torch.tensor([c + i], device=dev)  # [1]
            sync()
            t = time.perf_counter()
            out = step(input_ids=nxt[:, None], **{kw: cache}, cache_position=where,
                       position_ids=where.expand(b, 1), use_cache=True)
            nxt = out.logits[:, -1].argmax(-1).clone()  # [B]; cloned: a CUDA graph reuses its output buffer
            sync()
            if i >= 3:
                times.append(time.perf_counter() - t)
    kv = sum(layer.keys.numel() * layer.keys.element_size() * 2 for layer in cache.layers)  # the whole static cache
    return statistics.median(times), total, kv


def prefill_time(engine: Engine, rows: list[list[int]], design: str) -> float:
    """Seconds to prefill ``rows``: the runner's chunked prefill, or one HF forward of the whole batch."""
    from transformers import DynamicCache

    sync = _sync(torch.device(engine.device))
    # the serving path takes text (and tokenises it, timed); turning the rows back into text is the bench's own work
    texts = [engine.tokenizer.decode(r) for r in rows] if design == "packed" else []
    with torch.inference_mode():
        sync()
        t = time.perf_counter()
        if design == "engine":
            engine.runner.prefill(rows, engine.runner.new_cache())
        elif design == "packed":  # the serving path: packed passes of the runner's prefill chunk, each row's token
            loop = PackedLoop(engine.runner, mid=engine.n_layers // 2)
            cfg = GenerationConfig(max_new_tokens=1, stop_at_eos=False)
            loop.add([(text, cfg, TapSpec(), 1, None) for text in texts])
        else:
            ids = torch.tensor(rows, device=engine.device)  # [B, C]
            with plain_head(engine):
                engine.model(input_ids=ids, **{engine.runner.cache_kw: DynamicCache(config=engine.model.config)},
                             use_cache=True, logits_to_keep=1)
        sync()
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m",
                        help=f"embedded model, HF directory, or random weights in the shapes of {', '.join(SHAPES)}")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="weights' dtypes, comma-separated (or auto)")
    parser.add_argument("--weights", default="float,auto", help=f"weight formats, comma-separated, of {WEIGHTS} (auto: "
                        "what fastgate picks for the dtype and machine; a form measured already is skipped)")
    parser.add_argument("--designs", default=None, help=f"comma-separated, of {', '.join(DESIGNS)} (default: all; on a "
                        f"CPU all but {', '.join(CPU_SKIPS)})")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--contexts", default="30,600", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--compile-batches", default="1,16,64", help="batches the compiled designs run (compiles)")
    parser.add_argument("--compile-contexts", default="", help="contexts the compiled designs run ('': all)")
    parser.add_argument("--prefill", default="16x700",
                        help="ROWSxTOKENS prefilled by the engine, HF and llama.cpp ('' skips)")
    parser.add_argument("--prefill-rounds", type=int, default=3,
                        help="prefill rounds, the designs alternating; each row is a design's median (default: "
                             "%(default)s)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend of packed-compiled")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--max-minutes", type=float, default=0.0,
                        help="stop starting new measurements after this long (0: no limit); rows so far are written")
    parser.add_argument("--no-save", action="store_true", help="print the rows only (a smoke run)")
    args = parser.parse_args()
    shape = args.prefill.lower().split("x") if args.prefill else None
    if shape is not None and (len(shape) != 2 or not all(x.isdigit() and int(x) > 0 for x in shape)):
        # "0x0" crashed the prefill after every decode row was measured (an empty batch)
        parser.error(f"--prefill is ROWSxTOKENS, both > 0 (e.g. 16x700), or '' to skip it; got {args.prefill!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.designs is not None:
        designs = [d for d in args.designs.split(",") if d]
    else:
        designs = [d for d in DESIGNS if resolve_device(args.device).type == "cuda" or d not in CPU_SKIPS]
    unknown = sorted(set(designs) - set(DESIGNS))
    if unknown:
        parser.error(f"unknown designs {unknown}")
    formats = [canonical_weights(w) for w in args.weights.split(",") if w]
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    compile_batches = {int(b) for b in args.compile_batches.split(",") if b}
    compile_contexts = {int(c) for c in args.compile_contexts.split(",") if c} or set(contexts)
    device = resolve_device(args.device)
    flags = native_bf16_flags(cpu_flags())
    auto = choose_dtype("auto", device).name  # flags alone; load() also probes (its reason is in dtype_reason)
    machine = {"bf16_flags": " ".join(flags) or "none", "auto_dtype": auto, "threads": torch.get_num_threads(),
               "model": args.model, "device": str(device), "cpu": cpu_name(),
               "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    start = time.perf_counter()
    rows: list[dict] = []

    def out_of_time() -> bool:
        return bool(args.max_minutes) and time.perf_counter() - start > args.max_minutes * 60

    def emit(row: dict) -> None:
        """Keep ``row`` and write it now: a run cut short keeps what it measured."""
        rows.append(row)
        if not args.no_save:
            append_rows("engine", [row])

    torch_designs = [d for d in designs if d != "llama.cpp"]
    measured: set[tuple[str, str]] = set()  # (dtype, weights) as loaded: auto may resolve to a form listed too
    for dtype in args.dtypes.split(",") if torch_designs else ():  # --designs llama.cpp alone loads no model
        for fmt in formats:
            if out_of_time():
                break
            lm = build_model(args.model, args.device, dtype, fmt)
            held_key = (str(next(lm.model.parameters()).dtype), lm.weights)
            if held_key in measured:
                print(f"{dtype}/{fmt}: {held_key[1]} weights, measured already", file=sys.stderr)
                del lm
                continue
            measured.add(held_key)
            FIRST_STEP.clear()  # first steps are this model's
            engine = Engine(lm, prefix_cache=0, step="eager")  # every row prefilled whole; eager on CUDA too
            hf_engine = Engine(lm, prefix_cache=0, step="eager", forward="hf")  # HF's module tree, hooks for taps
            # the same model with the static step compiled (fastgate.engine.static_step): symbolic sizes (auto),
            # one graph for every bucket of more than one row
            compiled = Engine(lm, prefix_cache=0, step=StepConfig("compiled", backend=args.compile_backend))
            # and with sizes fixed per bucket: one graph per batch and width bucket
            bucket = Engine(lm, prefix_cache=0,
                            step=StepConfig("compiled", backend=args.compile_backend, sizes="bucket"))
            name = engine.dtype_name
            held_as = lm.weights  # auto resolved (fastgate.assets.quant.choose_weights)
            reason = lm.dtype_reason
            ids = {(b, c): prompt_ids(engine, b, c) for b in batches for c in contexts}
            times: dict[tuple[str, int, int], list[float]] = {}
            meta: dict[tuple[str, int, int], tuple[str, int, int]] = {}  # mode, cache width, KV bytes
            read_bandwidth(device)

            # held: read weight_bytes(held, b); ext_int4: the packed design's int4 products of few rows run the
            # runner's op, C++ over the plain codes
            def step_row(key: tuple[str, int, int], held=lm.model,
                         ext_int4=engine.runner.ops.backends["int4_matmul"] == "ext") -> None:
                d, b, c = key
                mode, width, kv = meta.pop(key)
                bw = bound_bandwidth(device)
                step = statistics.median(times[key])
                short = times.get((d, b, contexts[0]))
                read = weight_bytes(held, b, int4_plain=ext_int4 and d == "packed")
                bound = (read + kv) / bw
                emit({"kind": "step", "design": d, "mode": mode, "dtype": name, "weights": held_as,
                      "dtype_reason": reason, "batch": b, "context": c, "cache_width": width,
                      "step_ms": step * 1e3, "bound_ms": bound * 1e3, "of_bound": bound / step,
                      "vs_short": step / statistics.median(short) if short else 1.0,
                      "first_step_s": FIRST_STEP.get(key, float("nan")), "weights_MB": read / 1e6,
                      "kv_MB": kv / 1e6, "read_GBps": bw / 1e9, "compiles": compiles(), "rounds": len(times[key]),
                      **machine})

            for rnd in range(args.rounds):
                if rnd:
                    read_bandwidth(device)
                for b in batches:
                    for c in contexts:
                        for d in torch_designs:
                            if d in COMPILED and (b not in compile_batches or c not in compile_contexts):
                                continue
                            if out_of_time():
                                break
                            if d in ("packed", "padded", "hf-dynamic"):
                                t, width, kv = loop_step(engine, ids[(b, c)], args.steps, d)
                                mode = "compiled" if engine.runner.compiled else "eager"
                            elif d == "packed-hf":
                                t, width, kv = loop_step(hf_engine, ids[(b, c)], args.steps, d)
                                mode = "eager"
                            elif d in ("packed-compiled", "packed-compiled-bucket"):
                                eng = compiled if d == "packed-compiled" else bucket
                                t, width, kv = loop_step(eng, ids[(b, c)], args.steps, d)
                                mode = step_mode(eng)
                            elif d == "hf-eager":
                                with plain_head(engine):
                                    t, width, kv = hf_eager_step(engine, ids[(b, c)], args.steps)
                                mode = "eager"
                            else:
                                with plain_head(engine):
                                    t, width, kv = hf_static_compile_step(engine, ids[(b, c)], args.steps)
                                mode = "compiled"
                            times.setdefault((d, b, c), []).append(t)
                            meta[(d, b, c)] = (mode, width, kv)
                            print(f"{name}/{fmt} {d} batch {b} context {c}: {t * 1e3:.1f} ms", file=sys.stderr)
                            if rnd == args.rounds - 1:
                                step_row((d, b, c))  # its last sample: written now
                if out_of_time():
                    break
            for key in list(meta):  # cut short by --max-minutes: what has samples is written all the same
                step_row(key)
            if args.prefill and not out_of_time():
                n, length = (int(x) for x in args.prefill.lower().split("x"))
                batch_ids = prompt_ids(engine, n, length)
                prefill_designs = ("packed", "engine", "hf-eager")
                for d in prefill_designs:  # warm-up
                    prefill_time(engine, batch_ids, d)
                # the designs alternate, round by round, and each row is a design's median: a prefill takes seconds
                # and this VM drifts by 5-10% within minutes, so back-to-back minima compared designs across drift
                samples: dict[str, list[float]] = {d: [] for d in prefill_designs}
                tokenize: list[float] = []  # the packed design's own tokenising of the prompts (HF's row has ids)
                texts = [engine.tokenizer.decode(r) for r in batch_ids]
                for _ in range(max(1, args.prefill_rounds)):
                    for d in prefill_designs:
                        samples[d].append(prefill_time(engine, batch_ids, d))
                    t0 = time.perf_counter()
                    engine.runner.encode(texts, [1] * len(texts))
                    tokenize.append(time.perf_counter() - t0)
                for d in prefill_designs:
                    t = statistics.median(samples[d])
                    tok_s = statistics.median(tokenize) if d == "packed" else 0.0
                    print(f"{name}/{fmt} prefill {d} {n}x{length}: {t:.2f} s (median of {len(samples[d])})",
                          file=sys.stderr)
                    emit({"kind": "prefill", "design": d, "mode": "eager", "dtype": name, "weights": held_as,
                          "dtype_reason": lm.dtype_reason, "batch": n, "context": length,
                          "prefill_shape": f"{n} x {length} {PREFILL_FORMS[d]}", "prefill_s": t,
                          "prefill_rounds": len(samples[d]), "vs_hf": statistics.median(samples["hf-eager"]) / t,
                          "tokenize_s": tok_s,  # inside prefill_s; vs_hf_ids leaves it out
                          "vs_hf_ids": statistics.median(samples["hf-eager"]) / max(t - tok_s, 1e-9),
                          "tokens_per_s": n * length / t,
                          "weights_MB": weight_bytes(lm.model, n * length) / 1e6, **machine})
            del engine, hf_engine, compiled, bucket, lm
    if "llama.cpp" in designs and not out_of_time():
        run_llama_cpp(args, contexts, batches, machine, emit, out_of_time)
    steps = [r for r in rows if r["kind"] == "step"]
    if steps:
        print_table(steps, ["design", "mode", "dtype", "weights", "batch", "context", "cache_width", "step_ms",
                            "bound_ms", "of_bound", "vs_short", "first_step_s"])
    prefills = [r for r in rows if r["kind"] == "prefill"]
    if prefills:
        print_table(prefills, ["design", "dtype", "weights", "batch", "context", "prefill_s", "tokenize_s",
                               "tokens_per_s", "vs_hf", "vs_hf_ids"])
    print(f"bf16 flags: {machine['bf16_flags']}; auto picks {auto}; {compiles()} graphs compiled")
    if rows and not args.no_save:
        from _common import results_dir

        print(f"appended {len(rows)} rows to {results_dir() / 'engine.csv'}")


def run_llama_cpp(args, contexts: list[int], batches: list[int], machine: dict, emit, out_of_time) -> None:
    """The llama.cpp design on the model's GGUF: batch-1 decode steps at each context, and the ``--prefill`` batch
    (N × L, llama.cpp's batched decode) beside a 1 × L prefill (:func:`prefill_llama_cpp`)."""
    n, length = (int(x) for x in args.prefill.lower().split("x")) if args.prefill else (1, 0)
    threads = torch.get_num_threads()
    llm, path, note = open_llama_cpp(args.model, max([*contexts, length]) + args.steps + 16, threads)
    if llm is None:
        print(f"llama.cpp: skipped: {note}", file=sys.stderr)
        return
    if batches != [1]:
        print("llama.cpp: decode steps at batch 1 only (llama-cpp-python's Llama decodes one sequence)",
              file=sys.stderr)
    kind = gguf_type(path)
    cfg = json_config(args.model)
    size = gguf_step_bytes(path)
    read_bandwidth(torch.device("cpu"))
    bw = bound_bandwidth(torch.device("cpu"))
    info = {**machine, "device": "cpu", "dtype_reason": note, "weights": "gguf", "threads": threads,
            "weights_MB": size / 1e6}
    ids = {c: llama_cpp_prompt(llm, c) for c in contexts}
    times: dict[int, list[float]] = {}
    widths: dict[int, int] = {}
    written: set[int] = set()

    def write(c: int) -> None:  # context c's row: the median of its rounds so far
        step = statistics.median(times[c])
        kv = kv_bytes(cfg, widths[c])  # f16 keys and values
        bound = (size + kv) / bw
        emit({"kind": "step", "design": "llama.cpp", "mode": "native", "dtype": kind, "batch": 1,
              "context": c, "cache_width": widths[c], "step_ms": step * 1e3, "bound_ms": bound * 1e3,
              "of_bound": bound / step, "vs_short": step / statistics.median(times[contexts[0]]),
              "kv_MB": kv / 1e6, "read_GBps": bw / 1e9, "rounds": len(times[c]), **info})
        written.add(c)

    for rnd in range(args.rounds):
        if rnd and out_of_time():
            break
        for c in contexts:
            if rnd and out_of_time():
                break
            t, widths[c] = llm.step(ids[c], args.steps)  # timed in llama.cpp's process
            times.setdefault(c, []).append(t)
            print(f"{kind} llama.cpp batch 1 context {c}: {t * 1e3:.1f} ms", file=sys.stderr)
            if rnd == args.rounds - 1:
                write(c)
    for c in contexts:  # past --max-minutes: every context measured and not yet written, on the rounds it had
        if c in times and c not in written:
            write(c)
    if length and not out_of_time():
        prefill_llama_cpp(llm, args, n, length, kind, info, emit, out_of_time)
    llm.close()


def prefill_llama_cpp(llm, args, n: int, length: int, kind: str, info: dict, emit, out_of_time) -> None:
    """llama.cpp's prefill rows: the same work as the engine's and HF's, ``n`` different ``length``-token prompts
    decoded together in llama.cpp's own batches with a seq id each (bench/_llama_cpp.py: llama-server's ``n_batch``
    2048 / ``n_ubatch`` 512, ``n_seq_max`` = n), and beside it one ``length``-token prompt alone (``1 x N``,
    ``Llama.eval``). A warm-up of each, then ``--prefill-rounds`` rounds alternating the two (fewer past
    ``--max-minutes``, one at least); each row a median, ``prefill_shape`` what it measured."""
    ids = llama_cpp_prompt(llm, length + n)
    prompts = [ids[i:i + length] for i in range(n)]  # n different windows, as prompt_ids gives the engine
    length = len(prompts[0])
    _, single_tok = llm.prefill(prompts[0])  # warm-up
    _, batch_toks, ctx = llm.prefill_batch(prompts)  # warm-up (and the context and batches, built untimed)
    if batch_toks[0] != single_tok:
        print(f"llama.cpp: batched prefill's next token {batch_toks[0]} differs from the prompt alone's "
              f"{single_tok}", file=sys.stderr)
    batched, single = [], []
    for rnd in range(max(1, args.prefill_rounds)):
        if rnd and out_of_time():
            break
        batched.append(llm.prefill_batch(prompts)[0])
        single.append(llm.prefill(prompts[0])[0])
    shapes = [  # (rows, samples, what was measured)
        (n, batched, f"{n} x {length} batched: llama_decode of {ctx['decodes']} batches, {n} seq ids, n_batch "
                     f"{ctx['n_batch']}, n_ubatch {ctx['n_ubatch']}, n_ctx {ctx['n_ctx']} ({ctx['n_ctx_seq']} a "
                     "sequence)"),
        (1, single, f"1 x {length} one sequence (Llama.eval)"),
    ]
    for rows_n, samples, shape in shapes:
        t = statistics.median(samples)
        print(f"{kind} llama.cpp prefill {shape}: {t:.2f} s (median of {len(samples)})", file=sys.stderr)
        emit({"kind": "prefill", "design": "llama.cpp", "mode": "native", "dtype": kind, "batch": rows_n,
              "context": length, "prefill_shape": shape, "prefill_s": t, "prefill_rounds": len(samples),
              "tokens_per_s": rows_n * length / t, **info})


def json_config(model: str) -> dict[str, int]:
    """Layers, KV heads and head width of an embedded model, from its converted directory's ``config.json``."""
    import json

    from fastgate.assets.models import prepare

    config = json.loads((prepare(model) / "config.json").read_text())
    config = config.get("text_config", config)
    heads = int(config["num_attention_heads"])
    return {"layers": int(config["num_hidden_layers"]), "kv_heads": int(config.get("num_key_value_heads", heads)),
            "head_dim": int(config.get("head_dim") or config["hidden_size"] // heads)}


if __name__ == "__main__":
    main()
