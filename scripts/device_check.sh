#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (no network there; its image has torch,
# triton and transformers; msgspec travels as a wheel in .whl/, SmolLM2's config and
# tokenizer in .gpu_assets/smollm2/ — the weights are too big to carry, so the speed runs
# use random weights of SmolLM2's shape). In order of what matters most:
#   1. scripts/gpu_check.py: the engine on CUDA, greedy output vs transformers on the GPU
#   2. python -m llmbus.bench.kernels: Triton paged attention at real sizes, splits, vs SDPA
#   3. scripts/gpu_step_profile.py: a decode step's host time against its GPU time
#   4. llmbus bench throughput (W1) and latency (W0) on the GPU, bf16, then W1 in f32
# Each step has its own time limit so one hang cannot eat the others. Everything lands in
# $OUT: device_check.log (all output), gpu_check.json, kernels_bench.json/.md,
# gpu_step_profile.json.
set -u
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
LOG=$OUT/device_check.log
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name: $*" | tee -a "$LOG"
    timeout "$limit" "$@" >>"$LOG" 2>&1
    echo "== $name: rc=$? in $((SECONDS - start)) s" | tee -a "$LOG"
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
    nproc
} >>"$LOG" 2>&1

step gpu_check 90 python3 scripts/gpu_check.py --out "$OUT"
step kernels_bench 200 python3 -m llmbus.bench.kernels --out "$OUT"
MODEL=/tmp/smollm2-random
step random_model 45 python3 scripts/gpu_check.py --random-smollm2 .gpu_assets/smollm2 "$MODEL"
step step_profile 60 python3 scripts/gpu_step_profile.py --model "$MODEL" --batch 1 16 128 --out "$OUT"
step w1_bf16 90 python3 -m llmbus bench throughput --model "$MODEL" --dtype bfloat16
step w0_bf16 75 python3 -m llmbus bench latency --model "$MODEL" --dtype bfloat16
step w1_f32 90 python3 -m llmbus bench throughput --model "$MODEL" --dtype float32
grep -E "^== |ratio|tok/s|latency|checks passed|roofline|\| " "$LOG" | tail -n 60
