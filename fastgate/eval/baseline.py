"""The baseline pipeline ``bench/bench_e2e.py`` measures fastgate against: the same algorithms, run the way the
papers' code runs them (HF ``generate`` one prompt at a time, the papers' own formulations of the ops). Not to be
confused with :mod:`fastgate.ops.reference`, the torch references the fast ops are tested against.

* :class:`ReferenceEngine` answers one prompt (and one sample) at a time with HF
  ``generate(output_hidden_states=True, output_logits=True, return_dict_in_generate=True)``; stop strings are applied
  by post-processing the decoded text, and the gates' hidden-state signals come from a second full forward pass with
  ``output_hidden_states=True`` over prompt + answer (Probing-RAG's mean states, SeaKR's EOS state, CBDR's pre-answer
  state).
* :func:`reference_ops`: the engine's ops with SeaKR's eigenscore formulation (dense ``d×d`` centring matrix,
  einsum, logdet, per request) and the torch prober as the gating ops.
* :class:`ReferenceWordOps`: SCAAR App. B's growing-window decode alignment and DTR's per-document ``np.dot`` /
  ``arccos`` loop, in Python.

It shares the methods' control flow (prompts, gates' rules, retrieval), so for greedy decoding its answers must equal
fastgate's: that is what the benchmark checks besides the speed.
"""

from __future__ import annotations

import dataclasses
import math
import re
from types import MappingProxyType

import numpy as np
import torch

from fastgate.config import GenerationConfig, TapSpec
from fastgate.engine.local import Engine, FinishReason, Generation, GenerationBatch
from fastgate.errors import InputError
from fastgate.ops import Ops
from fastgate.ops.reference import probe_logits

__all__ = ["ReferenceEngine", "ReferenceWordOps", "reference_ops", "seakr_eigenscore", "use_reference_ops"]


def seakr_eigenscore(z: torch.Tensor, alpha: float = 1e-3, valid: torch.Tensor | None = None,
                     scale: str | None = None) -> torch.Tensor:
    """SeaKR's code, one request at a time: ``J_d = I - 11ᵀ/d``, ``Σ = z J_d zᵀ``, ``logdet(Σ + αI) / k`` (float64;
    invalid samples dropped; ``scale="cov"`` divides Σ by d - 1 as INSIDE's covariance does)."""
    out = []
    for b in range(z.shape[0]):
        zb = z[b].double()
        if valid is not None:
            zb = zb[valid[b].bool()]
        k, d = zb.shape
        if k == 0:
            out.append(torch.tensor(float("inf"), dtype=torch.float64))
            continue
        j_d = torch.eye(d, dtype=torch.float64) - torch.ones(d, d, dtype=torch.float64) / d
        sigma = torch.einsum("ij,jk,lk->il", zb, j_d, zb)
        if scale == "cov":
            sigma = sigma / max(d - 1, 1)
        out.append(torch.logdet(sigma + alpha * torch.eye(k, dtype=torch.float64)) / k)
    return torch.stack(out).float()


def _no_accumulate(*_args, **_kwargs):  # the reference engine sums states after generation, not per step
    raise RuntimeError("the reference engine does not accumulate taps per step")


def reference_ops(ops: Ops) -> Ops:
    """``ops`` with the baseline's gating ops: no per-step accumulate, the torch prober, SeaKR's eigenscore (the word
    and AIS ops stay ``ops``'s; :func:`use_reference_ops` swaps a method's own)."""
    gating = {"accumulate": "reference", "probe_logits": "reference", "eigenscore": "reference"}
    return dataclasses.replace(ops, backend="reference", backends=MappingProxyType({**ops.backends, **gating}),
                               accumulate=_no_accumulate, probe_logits=probe_logits, eigenscore=seakr_eigenscore)


_WORD = re.compile(r"[^\W_]+(?:['-][^\W_]+)*")  # letters/digits, joined by inner ' or -


class ReferenceWordOps:
    """The Python formulations of the papers' code for word alignment (SCAAR App. B) and AIS (DTR)."""

    backend = "reference"

    def align_word_logprobs_batch(self, batch_pieces, batch_logprobs):
        """Growing-window decode: decode every prefix of the tokens to learn which characters each token added, split
        the text into words, and average the log-probs of each word's tokens (a token belongs to the first word it
        touches)."""
        out = []
        for pieces, lps in zip(batch_pieces, batch_logprobs):
            lps = np.asarray(lps, dtype=np.float64)
            owner: list[int] = []
            text = ""
            for j in range(len(pieces)):
                window = b"".join(pieces[: j + 1]).decode("utf-8", errors="replace")  # the growing window
                keep = 0
                while keep < min(len(text), len(window)) and text[keep] == window[keep]:
                    keep += 1
                owner = owner[:keep] + [j] * (len(window) - keep)
                text = window
            words, word_ids = [], [-1] * len(pieces)
            for m in _WORD.finditer(text):
                words.append(m.group())
                for c in range(m.start(), m.end()):
                    if word_ids[owner[c]] < 0:
                        word_ids[owner[c]] = len(words) - 1
            sums = [0.0] * len(words)
            counts = [0] * len(words)
            for t, w in enumerate(word_ids):
                if w >= 0:
                    sums[w] += float(lps[t])
                    counts[w] += 1
            wlp = torch.tensor([s / c if c else 0.0 for s, c in zip(sums, counts)], dtype=torch.float32)
            out.append((words, word_ids, wlp))
        return out

    def ais_scores(self, q: torch.Tensor, p: torch.Tensor, docs: torch.Tensor, mode: str = "angle") -> torch.Tensor:
        """DTR's released code: one ``np.dot`` and ``arccos`` per document."""
        qn, pn, dn = (np.asarray(x.detach().cpu().numpy(), dtype=np.float64) for x in (q, p, docs))
        scores = []
        for doc in dn:
            s1 = float(np.clip(np.dot(doc, qn), -1, 1))
            s2 = float(np.clip(np.dot(doc, pn), -1, 1))
            scores.append(math.cos(math.acos(s1) + math.acos(s2)) if mode == "angle" else s1 + s2)
        return torch.tensor(scores, dtype=torch.float32)

    def ais_topk_batch(self, Q: torch.Tensor, P: torch.Tensor, D: torch.Tensor, k: int,
                       mode: str = "angle") -> tuple[torch.Tensor, torch.Tensor]:
        """DTR's released code for each question in turn: the per-document loop above, then a sort."""
        top_s, top_i = [], []
        for b in range(D.shape[0]):
            scores = self.ais_scores(Q[b], P[b], D[b], mode).tolist()
            order = sorted(range(len(scores)), key=lambda j: -scores[j])[:k]
            top_s.append([scores[j] for j in order])
            top_i.append(order)
        return torch.tensor(top_s, dtype=torch.float32), torch.tensor(top_i, dtype=torch.int64)


def use_reference_ops(method) -> None:
    """Switch a built method's word / AIS ops to :class:`ReferenceWordOps` (its gates already use the engine's)."""
    if hasattr(method, "ops"):
        method.ops = ReferenceWordOps()
    gate = getattr(method, "gate", None)
    if gate is not None and hasattr(gate, "words"):  # word gates align sentences with their own ops
        gate.ops = method.ops


class ReferenceEngine(Engine):
    """The :class:`~fastgate.engine.local.Engine` interface implemented with HF ``generate``, one prompt and one sample
    at a
    time, with Python post-processing (see the module docstring)."""

    def __init__(self, model) -> None:
        super().__init__(model, backend="torch", prefix_cache=0)  # HF generate prefills every prompt in full
        self.ops = reference_ops(self.ops)
        self.backend = "reference"

    def _cut(self, new: list[int], cfg: GenerationConfig) -> tuple[int, int, FinishReason, str | None, str]:
        """Replay the stopping rule on HF's tokens: ``(tokens kept, answer tokens, reason, stop string, text)``."""
        eos = set(self.eos_ids)
        for j in range(len(new)):
            if cfg.stop_at_eos and new[j] in eos:
                return j + 1, j, "eos", None, self.tokenizer.decode(new[:j], skip_special_tokens=True)
            text = self.tokenizer.decode(new[: j + 1], skip_special_tokens=True)
            hits = [(text.find(s), s) for s in cfg.stop if s in text]
            if hits:
                pos, s = min(hits)
                return j + 1, self._tokens_before(new[: j + 1], pos), "stop", s, text[:pos]
            if j + 1 >= cfg.max_new_tokens:
                return j + 1, j + 1, "length", None, text
        return len(new), len(new), "length", None, self.tokenizer.decode(new, skip_special_tokens=True)

    @torch.inference_mode()
    def generate(self, prompts: list[str], config: GenerationConfig | None = None, taps: TapSpec | None = None,
                 k: int = 1, seeds: list[int] | None = None) -> GenerationBatch:
        from transformers import GenerationConfig as HFGenerationConfig

        if not prompts:
            raise InputError("generate: no prompts")
        if not (config is None or isinstance(config, GenerationConfig)) or not (
                taps is None or isinstance(taps, TapSpec)) or not isinstance(k, int):
            return self._generate_rows(prompts, config, taps, k, seeds)
        cfg = config or GenerationConfig()
        taps = taps or TapSpec()
        mid = taps.mid_layer if taps.mid_layer is not None else self.n_layers // 2
        seqs: list[Generation] = []
        sums, counts, pre, eos_states = [], [], [], []
        for i, prompt in enumerate(prompts):
            rows, truncated = self.encode([prompt], cfg.max_new_tokens)
            ids, mask = self._pad(rows)
            plen = ids.shape[1]
            for j in range(k):
                if cfg.do_sample:
                    seed = (int(seeds[i]) * 1_000_003 + j) % (2**63) if seeds is not None else cfg.seed
                    if seed is not None:  # the engine's per-sample generator, as the global one
                        torch.manual_seed(seed)
                    sampling = {"do_sample": True, "temperature": cfg.temperature, "top_k": cfg.top_k or None,
                                "top_p": cfg.top_p}
                else:
                    sampling = {"do_sample": False}
                # a fresh config: the model's own generation defaults (repetition penalty, ...) must not apply
                gen_cfg = HFGenerationConfig(
                    max_new_tokens=cfg.max_new_tokens, eos_token_id=self.eos_ids if cfg.stop_at_eos else None,
                    pad_token_id=self.pad_id, stop_strings=list(cfg.stop) or None, output_hidden_states=True,
                    output_logits=True, return_dict_in_generate=True, **sampling)
                out = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg,
                                          tokenizer=self.tokenizer)
                new = out.sequences[0, plen:].tolist()
                kept, n_answer, reason, stop, text = self._cut(new, cfg)
                new = new[:kept]
                logps = [float(torch.log_softmax(out.logits[t][0].float(), -1)[tok]) for t, tok in enumerate(new)]
                seqs.append(Generation(text=text, token_ids=new, token_logprobs=logps, answer_tokens=n_answer,
                                       finish_reason=reason, prompt_tokens=plen, truncated=truncated[0],
                                       stop_string=stop))
                if taps.pre_answer:
                    pre.append(out.hidden_states[0][mid][0, -1].float())  # [d]: the prompt's last position
                if taps.layers or taps.eos_state:
                    ends_eos = bool(new) and new[-1] in set(self.eos_ids)
                    full = torch.tensor([ids[0].tolist() + new + ([] if ends_eos else [self.eos_id])])
                    hs = self.model(input_ids=full, output_hidden_states=True).hidden_states  # (n+1) × [1, T, d]
                    counted = kept - (1 if ends_eos else 0)  # EOS itself is not an answer token
                    if taps.layers:
                        sums.append(torch.stack([hs[layer][0, plen:plen + counted].float().sum(0)
                                                 for layer in taps.layers]))  # [L, d]
                        counts.append(float(counted))
                    if taps.eos_state:
                        eos_states.append(hs[mid][0, -1].float())  # [d]
        return GenerationBatch(
            sequences=seqs,
            running_sum=torch.stack(sums) if sums else None,
            count=torch.tensor(counts) if counts else None,
            pre_answer=torch.stack(pre) if pre else None,
            eos_state=torch.stack(eos_states) if eos_states else None,
            layers=tuple(taps.layers),
        )

    def _generate_rows(self, prompts, configs, taps, ks, seeds) -> GenerationBatch:
        """Rows with their own settings (the scheduler's calls): one prompt at a time, taps laid out as the engine
        lays them out (running sums over the union of the layers asked for)."""
        n = len(prompts)
        configs = list(configs) if isinstance(configs, (list, tuple)) else [configs] * n
        taps = list(taps) if isinstance(taps, (list, tuple)) else [taps] * n
        ks = list(ks) if isinstance(ks, (list, tuple)) else [ks] * n
        parts = [self.generate([p], c, t, kk, None if seeds is None or seeds[i] is None else [seeds[i]])
                 for i, (p, c, t, kk) in enumerate(zip(prompts, configs, taps, ks))]
        layers = tuple(sorted({x for t in taps if t is not None for x in t.layers}))
        d = self.lm.hidden_size
        total = sum(len(b.sequences) for b in parts)
        running = torch.zeros((total, len(layers), d)) if layers else None
        count = torch.zeros(total) if layers else None
        pre = torch.zeros((total, d)) if any(b.pre_answer is not None for b in parts) else None
        eos = torch.zeros((total, d)) if any(b.eos_state is not None for b in parts) else None
        pos = 0
        for b in parts:
            m = len(b.sequences)
            if b.running_sum is not None:
                for j, layer in enumerate(b.layers):
                    running[pos:pos + m, layers.index(layer)] = b.running_sum[:, j]
                count[pos:pos + m] = b.count
            if b.pre_answer is not None:
                pre[pos:pos + m] = b.pre_answer
            if b.eos_state is not None:
                eos[pos:pos + m] = b.eos_state
            pos += m
        return GenerationBatch(sequences=[s for b in parts for s in b.sequences], running_sum=running, count=count,
                               pre_answer=pre, eos_state=eos, layers=layers)

    @torch.inference_mode()
    def prompt_states(self, prompts: list[str], layer: int | None = None, batch_size: int = 16) -> torch.Tensor:
        layer = self.n_layers // 2 if layer is None else layer
        out = []
        for p in prompts:
            ids, mask = self._pad(self.encode([p], 1)[0])
            out.append(self.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
                       .hidden_states[layer][0, -1].float())
        return torch.stack(out)
