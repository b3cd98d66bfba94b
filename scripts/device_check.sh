#!/usr/bin/env bash
# The one prepared run for a lent GPU machine (no network there; its image has torch,
# triton and transformers; msgspec, opentelemetry-api and xgrammar (with its imports) travel as wheels in .whl/, SmolLM2's config and
# tokenizer in .gpu_assets/smollm2/ — `bash scripts/device_carry.sh` makes both; weights are
# random, of real shapes: `load_format="dummy"`). Carry: [".whl", ".gpu_assets"].
# Budget: about 8 minutes of a 15-minute lease, start-up included (the steps' limits add up
# to 8.75; they take less). In order of what matters most:
#   0. scripts/elementwise_check.py: the fused element-wise Triton kernels on the GPU (bits
#      against the PyTorch ops, microseconds a layer); if one fails to run, the rest runs
#      with LLMBUS_TRITON_ELEMENTWISE=0 (PyTorch ops) and the log says so
#   0b. scripts/host_step_times.py --device cuda: the engine's host work in a batch-128
#      decode step on the GPU, and its cProfile
#   1. scripts/gpu_check.py: greedy output vs transformers on the GPU, decode steps as CUDA
#      graphs (the default) and eager (--enforce-eager), every scheduling mode, speculation,
#      and each kind of structured output (its bitmask applied on the GPU)
#   2. scripts/gpu_figures.py: the figures of docs/gpu/latest.json — W0 ITL, W1 with graphs
#      against eager, GPU busy share of a batch-128 decode step, the 8B shape's batch-1 HBM
#      share, seeded draws equal to the CPU's
#      and a Mixtral-shaped MoE layer on the fused kernels against the per-expert loop
# (python -m llmbus.bench.kernels, Triton paged attention at real sizes, was measured on an
# H200 on 2026-11-30, docs/design/kernels.md; run it by hand when the attention kernel changes.)
#   3. `bash scripts/device_check.sh served`, a second call right after the first (the
#      machine stays warm 30 s; the two do not fit one call's 10 minutes):
#      scripts/served_check.py, `llmbus serve` on the GPU — served W0 ITL with the worker
#      overlapping steps and without, offline's in the same run, served greedy = offline,
#      and the GPU's busy share of a served batch-128 decode step (served.json's
#      served_gpu_busy_fraction_decode_b128: scheduling, stepping and detokenizing in
#      processes of their own) (needs the services' wheels too, docs/design/kernels.md; about 2
#      minutes), then
#      scripts/sampler_times.py on the GPU: each kind of request's sampling a step, then
#      scripts/images_gpu_check.py: images in (Gemma 3, Qwen2.5-VL, Qwen3-VL) against
#      transformers on the GPU (images_gpu_check.json), then
#      scripts/spec_gpu_figures.py: speculation with a draft model and an EAGLE-3 head at a
#      synthetic acceptance length (spec_figures.json); the served call's steps' limits add
#      up to 7 minutes: on a 15-minute lease run it in a session of its own if the first
#      call took its whole budget
# Each step has its own time limit so one hang cannot eat the others. Everything lands in
# $OUT: device_check.log (all output), gpu_check.json, latest.json (commit it as
# docs/gpu/latest.json), served.json (its figures go into latest.json too).
set -u
MODE=${1:-all}
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
LOG=$OUT/device_check.log
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH  # (bin: nats-server)
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name: $*" | tee -a "$LOG"
    timeout "$limit" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "== $name: rc=$rc in $((SECONDS - start)) s" | tee -a "$LOG"
    return $rc
}

{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
    nproc
    # What the engine imports beyond torch: a missing one is named here, not found by each step.
    python3 -c "
import importlib
names = ['triton', 'transformers', 'msgspec', 'opentelemetry.trace', 'tokenizers', 'safetensors', 'numpy', 'tqdm', 'xgrammar']
if '$MODE' == 'served':
    names += ['nats', 'fastapi', 'uvicorn', 'cryptography', 'httpx', 'prometheus_client', 'psutil']
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        print('MISSING', name, exc)
"
    [ "$MODE" = served ] && { command -v nats-server || echo "MISSING nats-server"; }
} >>"$LOG" 2>&1

if [ "$MODE" = served ]; then
    # (LLMBUS_API_SERVER_COUNT=4 bash scripts/device_check.sh served: the same with 4 gateways
    # on the port, served.json says how many: is one gateway what bounds served batch 128?)
    step served 170 python3 scripts/served_check.py --assets .gpu_assets/smollm2 --out "$OUT"
    # What each kind of request's sampling costs a step on the GPU (every other figure is greedy).
    step sampler_times 40 python3 scripts/sampler_times.py --device cuda --logits random --batch 1 128 --runs 2 \
        --repeats 20
    # Images in on the GPU: each family's greedy tokens against transformers' (Triton, CUDA graphs)
    step images 90 python3 scripts/images_gpu_check.py --out "$OUT"
    # Speculation with models: a Llama-3-8B-shaped target's time a token with a draft model
    # and an EAGLE-3 head at a synthetic acceptance length of 3, and the draft path at 1
    step speculative 120 python3 scripts/spec_gpu_figures.py --assets .gpu_assets/smollm2 --out "$OUT" --tokens 96 \
        --rounds 2
    grep -E "^== |^\{" "$LOG" | tail -n 20
    exit 0
fi
if ! step elementwise 45 python3 scripts/elementwise_check.py --out "$OUT"; then
    echo "== elementwise kernels failed: the rest runs with LLMBUS_TRITON_ELEMENTWISE=0" | tee -a "$LOG"
    export LLMBUS_TRITON_ELEMENTWISE=0
fi
# The engine's host work in a batch-128 decode step on the GPU, CUDA graphs and all (the
# step lasts at least that), and its cProfile (host_profile.txt): where the host's time goes.
step host_step_times 50 python3 scripts/host_step_times.py --assets .gpu_assets/smollm2 --device cuda --batch 128 \
    --runs 1 --cprofile 40 --out "$OUT"
step gpu_check 160 python3 scripts/gpu_check.py --out "$OUT"
step gpu_figures 270 python3 scripts/gpu_figures.py --assets .gpu_assets/smollm2 --out "$OUT" --gpu-check "$OUT/gpu_check.json"
grep -E "^== |^\{\"figure|checks passed|roofline|\| " "$LOG" | tail -n 60
