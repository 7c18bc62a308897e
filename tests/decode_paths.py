"""The fused pass's decode-only path against its general path on one model, for the tests that hold them bitwise
equal (tests/test_decode_attention.py, tests/test_quant_int4.py)."""

from __future__ import annotations

import dataclasses


def decode_path_runs(lm, prompt_sets, cfg, layers, mid, budget=None):
    """Generate each list of prompts in ``prompt_sets`` on ``lm`` (bf16, or float32 of quantized weights) with the
    C++ ops, once with the decode-only path (the runner's ``decode_attention_step``, with the rotary embedding in its
    call where the op binds that, and the products' fused forms: the norm before, the residual sum after) and once
    without it (None: every pass the general way).

    Returns ``(out, calls)``: ``out[fast][i]`` the (token ids, log-probs, running sum) of set ``i``'s prompts, and the
    rows of each decode-only call (``fast=True`` only).
    """
    from fastgate.config import TapSpec
    from fastgate.engine.model_runner import ModelRunner
    from fastgate.engine.packed import PackedLoop
    from fastgate.ops.decoder import no_decode_layers

    out, calls = {}, []
    for fast in (True, False):
        runner = ModelRunner(lm, backend="ext", prefix_cache=0, step="eager")
        inner = runner.ops.decode_attention_step
        step = None
        if fast:  # counting the rows of each call; the form with the rotary embedding in it too, where bound
            def step(*a, inner=inner):
                calls.append(a[0].shape[0])
                return inner(*a)

            step.float32 = getattr(inner, "float32", False)  # float32 rows run it too (AVX2 and FMA)
            roped = getattr(inner, "roped", None)
            if roped is not None:
                step.roped = lambda qkv, *a, roped=roped: calls.append(qkv.shape[0]) or roped(qkv, *a)
        # the per-op decode path (its whole layers in one call: tests/test_decode_layers.py)
        runner.ops = dataclasses.replace(runner.ops, decode_attention_step=step, decode_layers=no_decode_layers)
        out[fast] = []
        for prompts in prompt_sets:
            loop = PackedLoop(runner, mid=mid)
            tickets = loop.admit([(p, cfg, TapSpec(layers=layers), 1, None) for p in prompts])
            while loop.busy:
                loop.step(budget)
            out[fast].append([(list(t.result.sequences[0].token_ids), list(t.result.sequences[0].token_logprobs),
                               t.result.running_sum) for t in tickets])
    return out, calls
