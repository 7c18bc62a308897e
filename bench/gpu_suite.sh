#!/usr/bin/env bash
# The GPU checks of issue 35 in one command, for a lent GPU machine (nothing to download there): the GPU tests, then
# bench/bench_engine.py on CUDA (bf16 and float32; HF's StaticCache + torch.compile with CUDA graphs beside the
# engine's eager loops) on random weights in SmolLM2-135M's shapes and in Llama-3-8B's (GQA 32/8 heads, 4096 wide,
# 128k vocabulary; ~16 GB in bf16): timings need the shapes, not the weights, which are too large to carry (the
# converted SmolLM2 is 540 MB, the tree that travels at most 64 MiB). Everything it writes goes under $OUT (at most 8
# files come back from there): env.txt, install.log, tests.log, bench-*.log and engine.csv.
#
# Run from the repository root:  OUT=/tmp/out bash bench/gpu_suite.sh  [QUICK=1: batch 1 and 16, one round]
# The image's python3 holds torch; fastgate's code needs transformers 5 (env.txt names the version there: an older one
# fails at the first forward; carry its wheel as the device README says). The engine's compiled decode step
# (fastgate.engine.static_step: one static step, a CUDA graph per batch bucket) is the design packed-compiled, beside the eager
# packed loop and HF's static cache + torch.compile; tests/test_static_step.py has a CUDA test of it (inductor, graphs).
set -uo pipefail

OUT=${OUT:-bench/results/gpu-$(date -u +%Y%m%dT%H%M%SZ)}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
BATCHES=1,16,64
ROUNDS=2
if [ "${QUICK:-0}" = 1 ]; then BATCHES=1,16; ROUNDS=1; fi

{
  date -u
  nvidia-smi || echo "no nvidia-smi"
  "$PY" -c "import sys, torch, transformers; print(sys.version); print('torch', torch.__version__, 'cuda', \
torch.version.cuda, 'device', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None); \
print('transformers', transformers.__version__)"
  "$PY" -c "import triton; print('triton', triton.__version__)" || echo "no triton"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# fastgate itself, without its dependencies (no registry there); the C++ extension builds when cmake and pybind11
# are there, else the Python fallbacks run (FASTGATE_SKIP_EXT=1)
if ! "$PY" -m pip install --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1; then
  echo "-- retrying without the C++ extension" >> "$OUT/install.log"
  FASTGATE_SKIP_EXT=1 "$PY" -m pip install --no-deps --no-build-isolation -e . >> "$OUT/install.log" 2>&1 \
    || echo "fastgate did not install: see install.log"
fi

# 1. GPU tests: kernels and their parity with the references on CUDA, the engine and both loops, dtype selection
"$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_ops_parity.py tests/test_engine.py \
  tests/test_decode.py tests/test_precision.py tests/test_static_step.py -k "not eval_records and not ask_json" 2>&1 | tee "$OUT/tests.log"

# 2. the engine bench on CUDA; rows also go to bench/results/engine.csv, copied to $OUT at the end
"$PY" bench/bench_engine.py --device cuda --model smollm2-135m-shape --dtypes bfloat16,float32 --batches "$BATCHES" \
  --contexts 30,600 --compile-batches "$BATCHES" --prefill 16x700 --rounds "$ROUNDS" 2>&1 \
  | tee "$OUT/bench-smollm2-135m-shape.log"
"$PY" bench/bench_engine.py --device cuda --model llama3-8b-shape --dtypes bfloat16 --batches "$BATCHES" \
  --contexts 30,600 --compile-batches "$BATCHES" --prefill 16x700 --rounds "$ROUNDS" \
  --designs packed,packed-compiled,padded,hf-eager,hf-static-compile 2>&1 | tee "$OUT/bench-llama3-8b-shape.log"
cp bench/results/engine.csv "$OUT/engine.csv" 2>/dev/null || true
ls -l "$OUT"
