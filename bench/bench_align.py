"""Word-level confidence from generated tokens (SCAAR eq. 5), per token: fastgate vs the Python formulations.

Providers, in one run:
- ``ext``: ``align_words`` + ``word_logprobs`` in the C++ extension (token pieces, str or byte-level);
- ``python``: fastgate's pure-Python fallback of the same ops;
- ``scaar_window`` (real tokenizer): SCAAR App. B's alignment, decode the whole output into words, then grow a window
  of tokens and decode it until it equals the next word; compared with fastgate's full path on the same token ids
  (byte pieces from the tokenizer + the C++ ops, in ``ext_us_per_token``).

Rows: ``op``, ``pieces`` (``str`` or ``bytes``: what the ops were given; the tokenizer rows' are ``bytes``),
``tokens``, ``ext_us_per_token``, then ``python_us_per_token`` (the synthetic rows, ``op`` ``align_words+
word_logprobs``) or ``scaar_window_us_per_token`` and ``tokenizer`` (the SmolLM2 tokenizer, ``smollm2-135m``, when
prepared, else the tiny test one, ``tiny-bytelevel``; ``op`` ``token_ids->word_logprobs``), and ``speedup``.

Run: python bench/bench_align.py [--tokens 64,256,1024]. Appends to bench/results/align.csv.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import append_rows, median_time, print_table  # noqa: E402

from fastgate import ops  # noqa: E402

WORDS = ["The", " capital", " of", " Burkina", " Faso", " is", " Ouaga", "dou", "gou", ",", " naïve", " café",
         "'s", " state", "-of", "-the", "-art", " 1889", ".", " 🙂", "\n"]


def make_pieces(n: int, as_bytes: bool, seed: int = 0) -> list:
    rng = random.Random(seed)
    pieces = [rng.choice(WORDS) for _ in range(n)]
    if not as_bytes:
        return pieces
    data = "".join(pieces).encode()
    cuts = sorted(rng.sample(range(1, len(data)), n - 1))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]


def scaar_window(tokenizer, ids: list[int], logprobs: np.ndarray) -> np.ndarray:
    """SCAAR App. B, Algorithm 2: growing-window decode alignment, then the mean log-prob of each word's tokens."""
    words = tokenizer.decode(ids).split()
    out, buf, start, i1 = [], [], 0, 0
    for i2, tok in enumerate(ids):
        buf.append(tok)
        if i1 < len(words) and tokenizer.decode(buf).strip() == words[i1]:
            out.append(float(np.mean(logprobs[start:i2 + 1])))
            buf, start, i1 = [], i2 + 1, i1 + 1
    if buf:
        out.append(float(np.mean(logprobs[start:])))
    return np.asarray(out, dtype=np.float32)


def tokenizer_rows(ext, ns: list[int]) -> list[dict]:
    """fastgate's path from token ids (pieces + C++ ops) vs SCAAR's growing window, on the SmolLM2 tokenizer when it
    is prepared, else the tiny test tokenizer."""
    from fastgate.assets.paths import models_dir
    from fastgate.engine.model_runner import _piece_decoder

    path = models_dir() / "smollm2-135m-hf-v1"
    if path.is_dir():
        from transformers import AutoTokenizer

        tokenizer, name = AutoTokenizer.from_pretrained(str(path)), "smollm2-135m"
    else:
        from fastgate.testing import tiny_model

        tokenizer, name = tiny_model().tokenizer, "tiny-bytelevel"
    pieces_of = _piece_decoder(tokenizer)
    rows = []
    for n in ns:
        rng = random.Random(n)
        text = "".join(rng.choice(WORDS) for _ in range(2 * n))
        ids = tokenizer(text)["input_ids"][:n]
        logprobs = np.random.default_rng(0).uniform(-3, 0, len(ids))

        def fastgate_path():
            return ext.align_word_logprobs_batch([pieces_of(ids)], [logprobs])

        t_fast = median_time(fastgate_path)
        t_ref = median_time(lambda: scaar_window(tokenizer, ids, logprobs), repeat=3)
        rows.append({"op": "token_ids->word_logprobs", "pieces": "bytes", "tokenizer": name, "tokens": len(ids),
                     "ext_us_per_token": t_fast / len(ids) * 1e6, "scaar_window_us_per_token": t_ref / len(ids) * 1e6,
                     "speedup": t_ref / t_fast})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="64,256,1024")
    args = parser.parse_args()
    if not ops.ext_available():
        sys.exit("fastgate._C is not built: pip install -e .")
    ext, py = ops.build_ops("ext", "cpu"), ops.build_ops("python", "cpu")
    rows = []
    for n in (int(x) for x in args.tokens.split(",")):
        for as_bytes in (False, True):
            pieces = make_pieces(n, as_bytes)
            logprobs = np.random.default_rng(0).uniform(-3, 0, n)

            def run(backend):
                def fn():
                    _, ids = backend.align_words(pieces)
                    backend.word_logprobs(logprobs, ids)
                return fn

            assert ext.align_words(pieces) == py.align_words(pieces)
            t_ext, t_py = median_time(run(ext)), median_time(run(py))
            rows.append({"op": "align_words+word_logprobs", "pieces": "bytes" if as_bytes else "str", "tokens": n,
                         "ext_us_per_token": t_ext / n * 1e6, "python_us_per_token": t_py / n * 1e6,
                         "speedup": t_py / t_ext})
    print_table(rows, ["pieces", "tokens", "ext_us_per_token", "python_us_per_token", "speedup"])
    window = tokenizer_rows(ext, [int(x) for x in args.tokens.split(",")])
    print_table(window, ["tokenizer", "pieces", "tokens", "ext_us_per_token", "scaar_window_us_per_token", "speedup"])
    print(f"appended to {append_rows('align', rows + window)}")


if __name__ == "__main__":
    main()
