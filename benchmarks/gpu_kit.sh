#!/usr/bin/env bash
# The GPU kit: what a lent GPU runs first, in one prepared command. On a machine without a
# package index, begin with the shared set-up that brings optuna along (see the project's
# GPU notes). Each step writes its results under OUT as it goes, so a step stopped at its
# limit keeps what it measured.
#
#   bash benchmarks/gpu_kit.sh all          # <= 9 min (benchmarks/kit_slots.py): the
#                                           # preflight, GPT-2 124M, the allocator traces
#                                           # (with and without expandable segments), the
#                                           # 1B and the QLoRA 7B at 24 GiB against the
#                                           # expert's compiled config; one table
#   bash benchmarks/gpu_kit.sh jobs-rest    # the jobs' other budgets: GPT-2 at 16 GiB, the
#                                           # 1B LLaMA at the card's memory (MFU)
#   bash benchmarks/gpu_kit.sh table        # the table of what OUT holds
#
# Single steps:
#   bash benchmarks/gpu_kit.sh tests        # the CUDA tests and the stand-in's
#   bash benchmarks/gpu_kit.sh calibrate    # live / allocated / reserved / NVML vs predicted,
#                                           # and each step's allocator trace
#   bash benchmarks/gpu_kit.sh gpt2         # tuner benchmark, GPT-2 124M, 16 and 24 GiB,
#                                           # against the eager grid and accelerate's finder
#   bash benchmarks/gpu_kit.sh llama        # the same, ~1B LLaMA-style, 24 GiB
#   bash benchmarks/gpu_kit.sh eager        # GPT-2 at 24 GiB without compiled blocks
#   bash benchmarks/gpu_kit.sh offload      # offload overhead and transfer-time prediction
#   bash benchmarks/gpu_kit.sh plan         # a plan made as without the GPU (fake tensors),
#                                           # its config then run and tuned on the GPU
#
# The QLoRA job needs bitsandbytes, which the GPU machines lack: bring its wheel with the
# shared set-up (bash ../shared/gpu/kit.sh bitsandbytes).
# KIT_SMOKE=1 runs `all` on the CPU at tiny shapes, so that a GPU never spends minutes on
# a script error; KIT_SMOKE_JOBS="gpt2-124m" runs only those jobs of it (CI's smoke run:
# `python -m pytest -m sweep tests/test_gpu_kit.py` runs every job, before a GPU call).
# The CUDA tests are no longer in `all` (they passed on the last GPU): `tests` runs them.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/gpu-results}"
mkdir -p "$out"
smoke="${KIT_SMOKE:-}"

# One step under a time limit: its output in OUT/NAME.log too; a failure or a stop at
# the limit is said, and the kit goes on to the next step.
step() {
  local name="$1" limit="$2"; shift 2
  echo "== $name (at most ${limit} s)" >&2
  local started=$SECONDS
  # SIGINT first: pytest still writes its JUnit XML, the scripts keep what they wrote.
  timeout --signal=INT --kill-after=10 "$limit" "$@" > >(tee "$out/$name.log") 2>&1
  local rc=$?
  echo "== $name: exit $rc after $((SECONDS - started)) s" >&2
  return "$rc"
}

meter=()  # the driver's view of a whole command, where the GPU notes' meter is at hand
if [ -z "$smoke" ] && [ -f .gpu/peakwatch.py ]; then meter=(python .gpu/peakwatch.py --); fi

case "${1:-}" in
  all)
    # In the order a call must bring back, each step in its slot (benchmarks/kit_slots.py):
    # the preflight (the kit stops if it refuses), GPT-2 124M in a slot of its own, the
    # allocator traces of GPT-2 (two micro-batches, kept and checkpointed, without and
    # with expandable segments), then the 1B and the QLoRA 7B. A job's row is written
    # after each of its phases, so a job its slot stops keeps what finished.
    jobs=(gpt2-124m llama-1b qlora-7b)
    if [ -n "$smoke" ]; then
      # shellcheck disable=SC2206  # the job names, one word each
      jobs=(${KIT_SMOKE_JOBS:-${jobs[*]}})
      device=(--device cpu); run=(--smoke); trace=(--small --precisions fp32)
      scale=6  # the CPU at tiny shapes: slower per unit of work than a GPU at full size
    else
      device=(); run=(--budgets 24GiB); trace=(--precisions bf16); scale=1
    fi
    slot() { echo $(( $(python benchmarks/kit_slots.py "$1") * scale )); }
    step preflight "$(slot preflight)" python benchmarks/gpu_preflight.py ${device[@]+"${device[@]}"} \
      || { echo "== the preflight refused: nothing else runs" >&2; exit 1; }
    job() {
      step "$1" "$(slot "$1")" ${meter[@]+"${meter[@]}"} env TORCH_LOGS=recompiles,graph_breaks \
        python benchmarks/gpu_jobs.py "${run[@]}" ${device[@]+"${device[@]}"} --only "$1" \
        --out "$out/jobs-$1.json"
    }
    for name in "${jobs[@]}"; do
      if [ "$name" = gpt2-124m ]; then job "$name"; fi
    done
    traces=(python benchmarks/calibrate.py ${device[@]+"${device[@]}"} "${trace[@]}" --sizes 2 4
            --variants kept ckpt --no-estimate)
    step traces "$(slot traces)" "${traces[@]}" --out "$out/calibration.json" \
      --traces "$out/allocator-traces"
    step traces-expandable "$(slot traces-expandable)" env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
      "${traces[@]}" --out "$out/calibration-expandable.json" --traces "$out/allocator-traces"
    for name in "${jobs[@]}"; do
      if [ "$name" != gpt2-124m ]; then job "$name"; fi
    done
    if [ -n "$smoke" ]; then  # the dry run: this work at the last GPU's speeds, in its slots
      step slots 30 python benchmarks/kit_slots.py --check "$out"/jobs-*.json
    fi
    python benchmarks/gpu_jobs.py --table "$out" ;;
  jobs-rest)
    step jobs-rest 540 ${meter[@]+"${meter[@]}"} python benchmarks/gpu_jobs.py --budgets 16GiB card --cold-first-step \
      --out "$out/jobs-rest.json" ;;
  table)     python benchmarks/gpu_jobs.py --table "$out" ;;
  tests)     python -m pytest -q tests/device/test_cuda.py tests/device/test_caching_device.py \
               --junitxml="$out/cuda-tests.xml" ;;
  calibrate) python benchmarks/calibrate.py --device cuda --out "$out/calibration.json" \
               --traces "$out/traces" ;;
  gpt2)      python benchmarks/run.py --device cuda --cases gpt2-124m --budgets 16GiB 24GiB \
               --rounds 3 --out "$out/tune-gpt2.json" ;;
  llama)     python benchmarks/run.py --device cuda --cases llama-1b --budgets 24GiB \
               --rounds 3 --out "$out/tune-llama.json" ;;
  eager)     python benchmarks/run.py --device cuda --cases gpt2-124m --budgets 24GiB \
               --compile off --rounds 3 --out "$out/tune-gpt2-eager.json" ;;
  offload)   python benchmarks/offload.py --device cuda --out "$out/offload.json" ;;
  plan)      python benchmarks/plan_vs_gpu.py --device cuda --out "$out/plan-vs-gpu.json" ;;
  *) echo "usage: bash benchmarks/gpu_kit.sh all|jobs-rest|table|tests|calibrate|gpt2|llama|eager|offload|plan" >&2
     exit 2 ;;
esac
