"""A tiny random Llama with an in-process BPE tokenizer, for fast tests and benchmarks (no downloads)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import socket
import threading
import time
from collections.abc import Iterator

import torch

from fastgate.assets.models import LoadedModel

__all__ = ["assert_greedy_equals_hf_generate", "free_port", "random_linear", "serve_in_thread", "tiny_gemma3",
           "tiny_model", "tiny_runtime", "TINY_CORPUS"]

def assert_greedy_equals_hf_generate(engine, max_new_tokens: int = 8) -> None:
    """The engine's greedy tokens for two prompts equal HF's own ``generate`` over the same modules (the quantized
    layers' tests run it on an int8 and an int4 tiny model); its log-probs are floats and its taps float32."""
    from fastgate.config import GenerationConfig, TapSpec

    lm = engine.lm
    prompts = ["Q: What is the capital of France?\nA:", "Who wrote Hamlet?"]
    batch = engine.generate(prompts, GenerationConfig(max_new_tokens=max_new_tokens, stop_at_eos=False),
                            TapSpec(layers=(1, 4)))
    for prompt, seq in zip(prompts, batch.sequences):
        enc = lm.tokenizer(prompt, return_tensors="pt")
        out = lm.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=lm.tokenizer.pad_token_id)
        assert list(seq.token_ids) == out[0, enc.input_ids.shape[1]:].tolist()
        assert all(isinstance(lp, float) for lp in seq.token_logprobs)
    assert batch.running_sum.dtype is torch.float32


def random_linear(k: int, n: int, bias: bool = False, seed: int = 0) -> torch.nn.Linear:
    """A float32 ``nn.Linear(k, n)`` with seeded small random weights (std 0.05) and bias: the quantized layers'
    tests quantize it and compare against it."""
    gen = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn((n, k), generator=gen) * 0.05)
        if bias:
            lin.bias.copy_(torch.randn((n,), generator=gen))
    return lin


TINY_CORPUS = [
    "Q: What is the capital of France?\nA: Paris",
    "Q: Who wrote Hamlet?\nA: William Shakespeare",
    "The quick brown fox jumps over the lazy dog. It's a well-known pangram!",
    "Berlin is the capital of Germany; Tokyo is the capital of Japan. 1889, 2024, naïve café — Zürich.",
    "Ouagadougou is the capital of Burkina Faso. Bishkek is the capital of Kyrgyzstan. 🙂 emoji ✓",
]


@functools.lru_cache(maxsize=4)
def _tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TINY_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_model(n_layers: int = 4, hidden: int = 64, seed: int = 1, vocab_size: int = 384,
               dtype: torch.dtype = torch.float32, attention_bias: bool = False) -> LoadedModel:
    """Build a tiny random Llama (CPU) and its BPE tokenizer; deterministic for a given seed. The weights are drawn
    in float32 and then cast to ``dtype`` (tests keep float32 and its exact comparisons; bf16 only runs);
    ``attention_bias``: q/k/v/o projections with biases (as Qwen2's q/k/v have)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _tokenizer(vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        initializer_range=0.1,
        attention_bias=attention_bias,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger logits than the default init, so greedy choices are well separated
        model.lm_head.weight.mul_(4.0)
    model.to(dtype)
    key = f"tiny-{n_layers}-{hidden}-{seed}-{vocab_size}" + ("-bias" if attention_bias else "")
    fingerprint = hashlib.sha256(key.encode()).hexdigest()[:16]
    return LoadedModel(name="tiny", model=model, tokenizer=tokenizer, path=None, fingerprint=fingerprint)


def tiny_gemma3(n_layers: int = 4, hidden: int = 64, seed: int = 1, vocab_size: int = 384) -> LoadedModel:
    """A tiny random Gemma-3 text model (sliding-window layers every layer but the last, window 8) with the same
    tokenizer: the model family whose KV cache cannot take rows into a running loop (fp32, CPU, deterministic)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tokenizer = _tokenizer(vocab_size)
    config = Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512,
        sliding_window=8, layer_types=["sliding_attention"] * (n_layers - 1) + ["full_attention"],
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, initializer_range=0.1,
    )
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config).eval()
    fingerprint = hashlib.sha256(f"tiny-gemma3-{n_layers}-{hidden}-{seed}-{vocab_size}".encode()).hexdigest()[:16]
    return LoadedModel(name="tiny-gemma3", model=model, tokenizer=tokenizer, path=None, fingerprint=fingerprint)


def tiny_runtime(index: str | None = None):
    """A :class:`~fastgate.serving.runtime.Runtime` on the tiny model over the indexes at ``index`` (for servers in
    other
    processes, e.g. Ray Serve replicas in tests: every process builds the same weights)."""
    from fastgate.engine.local import Engine
    from fastgate.serving.runtime import Runtime

    return Runtime("tiny", index=index, engine=Engine(tiny_model()))


def _loopback_socket() -> socket.socket:
    """A socket bound to a free loopback port."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    return s


def free_port() -> int:
    """A loopback port free now (for test and benchmark servers that bind it themselves, e.g. Ray Serve's)."""
    with _loopback_socket() as s:
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app, timeout_s: float = 30) -> Iterator[int]:
    """Serve the ASGI ``app`` with uvicorn on a free loopback port in a daemon thread; yields the port, stops it
    after."""
    import uvicorn

    # the socket bound here and handed to uvicorn: a port found free and bound later could be taken in between
    # (tests run in parallel workers)
    sock = _loopback_socket()
    port = sock.getsockname()[1]
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + timeout_s
    while not srv.started and time.time() < deadline:
        time.sleep(0.05)
    if not srv.started:
        srv.should_exit = True
        sock.close()
        raise RuntimeError(f"the test server did not start within {timeout_s:g} s")
    try:
        yield port
    finally:
        srv.should_exit = True
        thread.join(timeout=10)
        sock.close()
