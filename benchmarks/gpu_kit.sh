#!/usr/bin/env bash
# The GPU kit (issue 10): one step per call, each under 8 minutes on one H100, each
# writing its JSON (or XML) under OUT as it goes. On a machine without a package index,
# begin with the shared set-up that brings optuna along (see the project's GPU notes).
#
#   bash benchmarks/gpu_kit.sh tests        # the CUDA tests and the stand-in's
#   bash benchmarks/gpu_kit.sh calibrate    # live / allocated / reserved / NVML vs predicted
#   bash benchmarks/gpu_kit.sh gpt2         # tuner benchmark, GPT-2 124M, 16 and 24 GiB
#   bash benchmarks/gpu_kit.sh llama        # tuner benchmark, ~1B LLaMA-style, 24 GiB
#   bash benchmarks/gpu_kit.sh eager        # GPT-2 at 24 GiB without compiled blocks: what
#                                           # compiling (on by default on CUDA) buys and costs
#   bash benchmarks/gpu_kit.sh offload      # offload overhead and transfer-time prediction
#   bash benchmarks/gpu_kit.sh plan         # a plan made as without the GPU (fake tensors),
#                                           # its config then run and tuned on the GPU
set -euo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/gpu-results}"
mkdir -p "$out"
case "${1:-}" in
  tests)     python -m pytest -q tests/test_cuda.py tests/test_caching_device.py \
               --junitxml="$out/cuda-tests.xml" ;;
  calibrate) python benchmarks/calibrate.py --device cuda --out "$out/calibration.json" ;;
  gpt2)      python benchmarks/run.py --device cuda --cases gpt2-124m --budgets 16GiB 24GiB \
               --rounds 3 --out "$out/tune-gpt2.json" ;;
  llama)     python benchmarks/run.py --device cuda --cases llama-1b --budgets 24GiB \
               --rounds 3 --out "$out/tune-llama.json" ;;
  eager)     python benchmarks/run.py --device cuda --cases gpt2-124m --budgets 24GiB \
               --compile off --rounds 3 --out "$out/tune-gpt2-eager.json" ;;
  offload)   python benchmarks/offload.py --device cuda --out "$out/offload.json" ;;
  plan)      python benchmarks/plan_vs_gpu.py --device cuda --out "$out/plan-vs-gpu.json" ;;
  *) echo "usage: bash benchmarks/gpu_kit.sh tests|calibrate|gpt2|llama|eager|offload|plan" >&2
     exit 2 ;;
esac
