"""align_words + word_logprobs: the C++ extension vs the pure-Python reference, per generated token.

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", default="64,256,1024")
    args = parser.parse_args()
    if not ops.ext_available():
        sys.exit("fastgate._C is not built: pip install -e .")
    ext, py = ops.load("ext"), ops.load("python")
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
    print(f"appended to {append_rows('align', rows)}")


if __name__ == "__main__":
    main()
