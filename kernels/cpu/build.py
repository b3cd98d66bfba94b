"""Compile the CPU kernels once per machine and load them with ctypes.

The sources are a few hundred lines of C++ with AVX-512 intrinsics and no PyTorch headers,
so g++ builds them in seconds, one source per core at once (a PyTorch C++ extension would
spend most of a minute on torch's headers). The library is built for the CPU it runs on
(-march=native) and kept under $LLMBUS_HOME/kernels, named by a hash of the sources, the
flags, the compiler and the CPU, so a changed source or another machine gets its own build.

OpenMP: the library asks for libgomp.so.1, and PyTorch (imported first) has already loaded
its own copy under that name, so both share one thread pool instead of fighting over the
cores.

Anything that stops the build (no compiler, a CPU without AVX-512 BF16, LLMBUS_CPU_KERNELS=0)
returns None with the reason, and callers keep their PyTorch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger("llmbus.kernels")

SOURCE_DIR = Path(__file__).parent
# -ffp-contract=off: a multiply and an add stay two roundings, as in the PyTorch ops the
# kernels reproduce (rotary); where a kernel wants a fused multiply-add it says so.
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=c++17", "-ffp-contract=off"]
COMPILE_FLAGS = [flag for flag in FLAGS if flag != "-shared"]
REQUIRED_CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")


def cache_dir() -> Path:
    home = os.environ.get("LLMBUS_HOME") or Path.home() / ".cache" / "llmbus"
    return Path(home) / "kernels"


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def build_library(compiler: str | None = None) -> tuple[ctypes.CDLL | None, str]:
    """(library, "") or (None, why not)."""
    if os.environ.get("LLMBUS_CPU_KERNELS", "1") == "0":
        return None, "LLMBUS_CPU_KERNELS=0"
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"no kernels for {platform.machine()}"
    missing = [flag for flag in REQUIRED_CPU_FLAGS if flag not in cpu_flags()]
    if missing:
        return None, f"this CPU lacks {', '.join(missing)}"
    compiler = compiler or os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if not compiler:
        return None, "no C++ compiler (g++) on PATH"
    sources = sorted(SOURCE_DIR.glob("*.cpp"))
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"{compiler} --version failed: {exc}"
    digest = hashlib.sha256()
    for part in [version, " ".join(FLAGS), " ".join(sorted(cpu_flags()))]:
        digest.update(part.encode())
    for path in sorted(SOURCE_DIR.glob("*.cpp")) + sorted(SOURCE_DIR.glob("*.h")):
        digest.update(path.name.encode() + path.read_bytes())
    target = cache_dir() / f"llmbus_cpu_{digest.hexdigest()[:16]}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            # Build beside the target, then rename: two workers starting at once each
            # build their own file and the rename is atomic.
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                failure = _compile(compiler, sources, Path(tmp))
                if failure:
                    return None, f"compiling the CPU kernels failed: {failure}"
                os.replace(Path(tmp) / "lib.so", target)
            log.info("built CPU kernels", extra={"path": str(target)})
        except (OSError, subprocess.SubprocessError) as exc:
            return None, f"building the CPU kernels failed: {exc}"
    try:
        return ctypes.CDLL(str(target)), ""
    except OSError as exc:
        return None, f"loading {target} failed: {exc}"


def _compile(compiler: str, sources: list[Path], tmp: Path) -> str:
    """Each source to an object file, as many at once as there are cores (-O3 over the
    intrinsics takes a core ~17 s), then one link into tmp/lib.so. "" or the compiler's
    complaint."""
    def run(argv: list[str]) -> str:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        return "" if result.returncode == 0 else (result.stderr.strip() or f"{argv[0]} exited {result.returncode}")

    objects = [tmp / (source.stem + ".o") for source in sources]
    with ThreadPoolExecutor(max(1, min(len(sources), os.cpu_count() or 1))) as pool:
        failures = [f for f in pool.map(lambda so: run([compiler, *COMPILE_FLAGS, "-c", str(so[0]), "-o", str(so[1])]),
                                         zip(sources, objects)) if f]
    if failures:
        return failures[0][-2000:]
    return run([compiler, *FLAGS, *map(str, objects), "-o", str(tmp / "lib.so")])[-2000:]
