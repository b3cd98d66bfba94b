"""The engine end to end on a GPU: greedy output against transformers on the same GPU.

CI has no GPU, so the CUDA path of the worker (Triton attention and KV writes, inputs on
the device, sampling there) is only exercised where a GPU is lent. This runs the same
cases as tests/test_engine_correctness.py — plain batch, chunked prefill, prefix-cache
hits, preemption, block size 32 — on tiny random models (llama: head dim 16; qwen2 with
q/k/v biases; a llama with head dim 64 and GQA 3, SmolLM2's layout) in float32, where
the output must equal transformers' token for token, and reports bfloat16's agreement
and a float8 KV cache's; that overlapped steps make no synchronizing call but the one they
mean to (torch's sync debug mode) and that a step launches while the GPU is busy (a
driver's wait, which that mode cannot see: host_waits); each kind of structured output; then the float8
cache's write and read on the GPU's kernels against the CPU path's bytes and the widened
cache's bits; a 4-bit AWQ checkpoint widened and on the Triton int4 kernel.

    python scripts/gpu_check.py --out $OUT    # writes gpu_check.json; exit 1 on a mismatch

`--random-smollm2 ASSETS DEST` instead writes a SmolLM2-shaped model with random weights
(ASSETS: a folder with SmolLM2's config.json and tokenizer files) for `llmbus bench` on a
machine the real checkpoint cannot be carried to.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402, F401 - Triton's interpreter with --cpu, before triton loads

from test_engine_correctness import MAX_NEW, PROMPTS  # noqa: E402 - the prompts those tests use
from tiny_models import build_tiny_model, hf_greedy, random_prompts  # noqa: E402

# name -> LLM keyword arguments; each must reproduce transformers' greedy output.
CASES = {
    "batch": {},
    "chunked_prefill": {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8},
    "preemption": {"num_kv_blocks": 12, "block_size": 16, "enable_prefix_caching": False},
    "preemption_chunked_prefix": {"num_kv_blocks": 12, "block_size": 16, "max_num_batched_tokens": 24},
    "block_size_32": {"block_size": 32, "max_num_batched_tokens": 40},
    # Every case above runs its decode steps as CUDA graphs (the default on a GPU); this
    # one runs them eager, so a graph bug and an eager bug show apart.
    "enforce_eager": {"enforce_eager": True},
    "sync_scheduling": {"async_scheduling": False},
    # Every case above overlaps steps (launched_step.py, the default on a GPU); this one
    # finishes each step before the next is launched.
    "no_overlap": {},
}
# Drafts verified as one-token rows of a decode step (the graphs take them too), on
# prompts that repeat themselves, so drafts are found and accepted.
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
               "disable_by_batch_size": None}

MODELS = {
    "llama_hd16": ("llama", {}),
    "qwen2_bias": ("qwen2", {}),
    "llama_hd64_gqa3": ("llama", {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3,
                                  "head_dim": 64, "intermediate_size": 256, "initializer_range": 0.08}),
    # Qwen3's q/k norms and a sparse layer on the grouped-GEMM kernels, a dense one beside it.
    "qwen3_moe": ("qwen3_moe", {}),
    # Gemma 2: the attention kernel's window and soft cap (constexpr switches), sandwich norms.
    # Not in a default run (its time is measured for the four above): `--models gemma2`.
    "gemma2": ("gemma2", {}),
    # gpt-oss: the attention kernel's sinks (with and without split-KV), biased experts with
    # its clamped SwiGLU on the grouped GEMMs, alternating windows: `--models gpt_oss`.
    "gpt_oss": ("gpt_oss", {}),
    # GLM-4.5: DeepSeek-V3's grouped sigmoid router (device ops: graphs take it), ungated
    # shared experts beside the grouped GEMMs, half-rotary heads: `--models glm4_moe`.
    "glm4_moe": ("glm4_moe", {}),
    # DeepSeek-V3: latent attention (one KV head of 40, the Triton kernel's masked head dims;
    # the absorbed products as batched matmuls: graphs take them), DeepSeek-V3's experts:
    # `--models deepseek_v3`.
    "deepseek_v3": ("deepseek_v3", {}),
    # Qwen3.5: Gated DeltaNet layers (their state's index ops in the decode graphs, the
    # chunked prefill's triangular solves) beside gated full attention: `--models qwen3_5`.
    "qwen3_5": ("qwen3_5", {}),
    # Granite 4.0-H: Mamba2 mixers (the plain linear recurrence), attention without
    # positions, experts beside a shared MLP: `--models granite_hybrid`. One group of B and C,
    # as Granite 4.0-H's checkpoints have: the lease image's transformers (5.17) norms the
    # gated output over all groups at once, which 5.23 (pyproject's pin, CI's oracle for two
    # groups) fixed; with one group both versions agree.
    "granite_hybrid": ("granite_hybrid", {"mamba_n_groups": 1}),
}
DEFAULT_MODELS = ["llama_hd16", "qwen2_bias", "llama_hd64_gqa3", "qwen3_moe"]


def greedy(llm, prompts, max_new=MAX_NEW):
    from llmbus import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def run_case(rows: list[dict], row: dict, check) -> None:
    """One case: `check()` returns what it measured ("identical" at least, where the case
    has an oracle); an exception becomes the row's error, so one broken case never hides
    the others' results. Printed as it lands (a run cut short keeps the log)."""
    start = time.perf_counter()
    try:
        row.update(check())
    except Exception as exc:  # noqa: BLE001 - reported, the other checks go on
        row.update(identical=False, error=repr(exc))
    row["seconds"] = round(time.perf_counter() - start, 2)
    print(json.dumps(row), flush=True)
    rows.append(row)


def check_model(name: str, arch: str, overrides: dict, root: Path, device: str) -> list[dict]:
    from llmbus import LLM

    folder = build_tiny_model(root / name, arch=arch, **overrides)
    reference = hf_greedy(folder, PROMPTS, MAX_NEW, device=device)
    rows = []
    for case, kwargs in CASES.items():
        def scheduling_mode(kwargs=kwargs, case=case) -> dict:
            llm = LLM(str(folder), **kwargs)
            llm.runner.overlap_steps = case != "no_overlap"
            out = greedy(llm, PROMPTS)
            graphs = llm.runner.decode_graphs
            return {"device": str(llm.runner.device), "identical": out == reference,
                    "preemptions": llm.stats().num_preemptions,
                    "graph_steps": graphs.steps if graphs is not None else 0}

        run_case(rows, {"model": name, "case": case, "dtype": "float32"}, scheduling_mode)

    def speculative() -> dict:
        # Short patterns repeated: prompt lookup finds drafts in them and in the cycles a
        # random model's greedy output falls into (longer ones left llama_hd64_gqa3 with
        # no draft accepted, so the case checked nothing).
        prompts = [p * 6 for p in random_prompts([2, 3, 4, 5], seed=9)]
        llm = LLM(str(folder), speculative_config=SPECULATIVE)
        accepted = llm.stats().spec_decode_num_accepted_tokens
        out = greedy(llm, prompts, 24)
        accepted = llm.stats().spec_decode_num_accepted_tokens - accepted
        row = {"identical": out == hf_greedy(folder, prompts, 24, device=device), "accepted_tokens": accepted}
        if not accepted:
            row["error"] = "no draft was accepted: the case checked nothing"
        return row

    from services.worker.models.decoder_config import ModelConfig

    if not ModelConfig.from_folder(folder).recurrent_layers:  # (a hybrid refuses drafts: its state cannot take them back)
        run_case(rows, {"model": name, "case": "speculative", "dtype": "float32"}, speculative)

    def penalized() -> dict:
        # Penalty counts on the device (penalties.py), the latest token read where it
        # was sampled while steps overlap: greedy with transformers' repetition_penalty.
        from llmbus import SamplingParams

        llm = LLM(str(folder))
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, repetition_penalty=1.8)
        out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        return {"identical": out == hf_greedy(folder, PROMPTS, MAX_NEW, device=device, repetition_penalty=1.8),
                "overlapped": llm.runner.overlap_steps}

    run_case(rows, {"model": name, "case": "penalized", "dtype": "float32"}, penalized)

    def prefix_hits() -> dict:
        # The first request fills the cache, the rest find its full blocks.
        prefix = random_prompts([48], seed=7)[0]
        prompts = [prefix + tail for tail in random_prompts([3, 9, 20, 1], seed=8)]
        llm = LLM(str(folder), block_size=16)
        out = greedy(llm, prompts[:1]) + greedy(llm, prompts[1:])
        return {"identical": out == hf_greedy(folder, prompts, MAX_NEW, device=device),
                "prefix_cache_hits": llm.stats().prefix_cache_hits}

    run_case(rows, {"model": name, "case": "prefix_hits", "dtype": "float32"}, prefix_hits)

    # Lower precisions: agreement with float32's transformers output, reported (not required).
    for case, kwargs in {"bfloat16_agreement": {"dtype": "bfloat16"},
                         "fp8_e4m3_cache_agreement": {"kv_cache_dtype": "fp8_e4m3"}}.items():
        def agreement(kwargs=kwargs) -> dict:
            out = greedy(LLM(str(folder), **kwargs), PROMPTS)
            return {"identical_prompts": f"{sum(a == b for a, b in zip(out, reference))}/{len(PROMPTS)}"}

        run_case(rows, {"model": name, "case": case, **kwargs}, agreement)
    return rows


def check_host_syncs(folder: Path, device: str) -> list[dict]:
    """Steps overlapped on the GPU (the default there) must not wait for the device but
    where they mean to (the sampled ids' copy back, by its event): any other wait, such as
    a synchronous host-to-device copy, runs each step after the one before it is done.
    Under torch's sync debug mode, greedy, seeded, top-k/top-p with logprobs, min_tokens
    and penalized requests decode side by side; every synchronizing call is reported where
    it is made."""
    from llmbus import LLM, SamplingParams

    def mixed(max_tokens: int) -> list[SamplingParams]:
        return [
            SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
            SamplingParams(temperature=0.8, seed=1, max_tokens=max_tokens, ignore_eos=True),
            SamplingParams(temperature=0.7, top_p=0.9, top_k=20, logprobs=2, max_tokens=max_tokens, ignore_eos=True),
            SamplingParams(temperature=0, min_tokens=4, max_tokens=max_tokens),
            SamplingParams(temperature=0, repetition_penalty=1.3, frequency_penalty=0.2, max_tokens=max_tokens,
                           ignore_eos=True),
            SamplingParams(temperature=0, logit_bias={7: 3.0}, allowed_token_ids=list(range(5, 60)),
                           max_tokens=max_tokens, ignore_eos=True),
        ]

    def host_syncs() -> dict:
        import warnings

        llm = LLM(str(folder))
        prompts = random_prompts([5, 9, 17, 3, 7], seed=3)
        params = mixed(16)
        prompts = prompts + prompts[:1]
        llm.generate(prompts, params, use_tqdm=False)  # Triton compiled, pinned blocks cached
        if device != "cuda":
            return {"skipped": "no CUDA: torch's sync debug mode needs it"}
        stacks, armed = [], [False]

        def record(message, category, filename, lineno, file=None, line=None):
            # (Only while generate runs: set_sync_debug_mode's own notice says "synchronizing"
            # too, and was the one "sync" left on an H200 once the step path had none.)
            if armed[0] and "synchroniz" in str(message).lower():  # the call chain, innermost first: ours, then any
                frames = traceback.extract_stack()[:-1]
                ours = [f"{Path(f.filename).name}:{f.lineno}" for f in frames
                        if f.filename.startswith(str(ROOT)) and "gpu_check" not in f.filename]
                inner = [f"{'/'.join(Path(f.filename).parts[-2:])}:{f.lineno}" for f in frames[-3:]]
                stacks.append(f"[{threading.current_thread().name}] " + " < ".join(reversed(ours[-4:]))
                              + " | " + " < ".join(reversed(inner)) + f" ({Path(filename).name}:{lineno})")

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            armed[0] = True
            try:
                llm.generate(prompts, params, use_tqdm=False)
            finally:
                armed[0] = False
                torch.cuda.set_sync_debug_mode("default")
        return {"identical": not stacks, "syncs": len(stacks), "where": sorted(set(stacks))[:20],
                "overlapped": llm.runner.overlap_steps}

    def host_waits() -> dict:
        """What the sync debug mode cannot see (a driver's wait, such as CUDA staging a
        pageable copy): with the GPU held busy by a ~50 ms kernel queued behind the step in
        flight, the next `step()` (it launches a step and lands the one before, queued ahead
        of the kernel) must come back long before the kernel is done. If it does not, the
        functions it waited in, by own time."""
        import cProfile
        import io
        import pstats

        if device != "cuda":
            return {"skipped": "no CUDA"}
        llm = LLM(str(folder))
        prompts = random_prompts([5, 9, 17, 3, 7], seed=5)
        llm.add_requests(prompts + prompts[:1], mixed(40))
        for _ in range(8):  # prefill, then steady decodes of every request
            llm.step()
        busy = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        busy[0].record()
        torch.cuda._sleep(10_000_000)
        busy[1].record()
        torch.cuda.synchronize()
        cycles = int(10_000_000 * 50 / busy[0].elapsed_time(busy[1]))  # ~50 ms of GPU time
        steps_ms, profile = [], cProfile.Profile()
        for _ in range(5):
            torch.cuda._sleep(cycles)
            start = time.perf_counter()
            llm.executor.call(profile.runcall, llm._loop.run_until_complete, llm._step())
            steps_ms.append(round((time.perf_counter() - start) * 1e3, 2))
            torch.cuda.synchronize()
        waited = max(steps_ms) > 25
        row = {"identical": not waited, "step_ms_with_gpu_busy_50ms": steps_ms}
        if waited:
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(6)
            row["where"] = text.getvalue().splitlines()[-12:]
        while llm.scheduler.has_unfinished_requests():
            llm.step()
        return row

    rows = []
    run_case(rows, {"model": folder.name, "case": "host_syncs", "dtype": "float32"}, host_syncs)
    run_case(rows, {"model": folder.name, "case": "host_waits", "dtype": "float32"}, host_waits)
    return rows


def check_structured(folder: Path, device: str) -> list[dict]:
    """Each kind of constraint with its token bitmask applied to logits on the GPU: greedy
    output equals transformers' on the same GPU under xgrammar's own logits processor."""
    from llmbus import LLM, SamplingParams

    rows = []
    try:
        from test_structured_outputs import MAX_TOKENS, SPECS, TEXTS, hf_constrained

        llm = LLM(str(folder))
        prompts = [llm.tokenizer.encode(text) for text in TEXTS]
    except Exception as exc:  # xgrammar (or jsonschema) not on the machine
        return [{"case": "structured", "identical": False, "error": repr(exc)}]
    for kind, spec in SPECS.items():
        def constrained(spec=spec) -> dict:
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured_outputs=spec),
                                use_tqdm=False)
            got = [[t for t in o.outputs[0].token_ids if t != llm.eos_token_id] for o in outs]
            return {"identical": got == hf_constrained(folder, spec, prompts, device=device)}

        run_case(rows, {"model": folder.name, "case": f"structured_{kind}", "dtype": "float32"}, constrained)
    return rows


def check_fp8(device: str) -> list[dict]:
    """The float8 KV cache on the GPU's kernels: the Triton write stores the bytes the CPU
    path stores (PyTorch's rounding, saturated), and attention over a float8 cache gives
    the bits it gives over the cache widened to the queries' dtype."""
    from kernels.paged_attention import paged_attention
    from kernels.reshape_and_cache import reshape_and_cache
    from services.worker.attention.kv_cache_dtype import to_cache_dtype
    from llmbus.bench.attention_batches import make_batch
    from services.worker.attention.torch_backend import write_kv_cache
    from test_fp8_kv_cache import awkward_values

    rows = []
    for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
        for dtype in (torch.bfloat16, torch.float32):
            values = awkward_values(fmt).to(dtype)
            slots = torch.randperm(values.shape[0])
            expected = torch.zeros(2, values.shape[0], 1, 1, 64, dtype=fmt)
            write_kv_cache(values, -values, expected, slots)  # on the CPU
            cache = torch.zeros_like(expected, device=device)
            reshape_and_cache(values.to(device), -values.to(device), cache[0], cache[1], slots.to(device))
            got_bytes, want_bytes = cache.cpu().view(torch.uint8), expected.view(torch.uint8)
            write_same = torch.equal(got_bytes, want_bytes)
            # Which values the GPU wrote otherwise (value, CPU byte, GPU byte), for the log:
            # slot s holds row s's keys in cache[0] and their negations in cache[1].
            differ = (got_bytes != want_bytes).nonzero().tolist()
            written = values.view(-1, 64).float()
            unlike = [[(1 - 2 * kv) * written[int((slots == s).nonzero()[0, 0]), d].item(),
                       int(want_bytes[kv, s, 0, 0, d]), int(got_bytes[kv, s, 0, 0, d])]
                      for kv, s, _, _, d in differ[:8]]
            query, kv_cache, md = make_batch([1, 1, 7], [9, 300, 30], 32, 8, 128, 16, dtype, seed=3)
            cache8 = to_cache_dtype(kv_cache, fmt).to(device)
            args = (md.block_table.to(device), md.query_start_loc.to(device), md.seq_lens.to(device),
                    md.max_query_len, 128**-0.5)
            q = query.to(device)
            read_same = torch.equal(paged_attention(q, cache8[0], cache8[1], *args),
                                    paged_attention(q, cache8[0].to(dtype), cache8[1].to(dtype), *args))
            row = {"model": "-", "case": f"fp8_kernels_{str(fmt).removeprefix('torch.')}_{str(dtype).removeprefix('torch.')}",
                   "dtype": str(dtype), "identical": write_same and read_same, "write_same": write_same,
                   "read_same": read_same, "bytes_unlike": len(differ), "first_unlike": unlike}
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def check_int4(root: Path, device: str) -> list[dict]:
    """4-bit checkpoints (an AWQ folder of a tiny Llama, tests/quantized_checkpoints.py): in
    float32 widened, equal to transformers on compressed-tensors' reading of it; in bfloat16
    served at 4 bits (on a GPU the Triton kernel, kernels/linear_int4.py, its decode steps
    as CUDA graphs), the same tokens as its eager steps, and its agreement with float32's
    reported (not required)."""
    from quantized_checkpoints import awq_checkpoint, dense_reference
    from llmbus import LLM

    source = build_tiny_model(root / "int4_source", arch="llama", hidden_size=128, intermediate_size=256)
    folder = awq_checkpoint(source, root / "int4_awq", group_size=32)
    reference = hf_greedy(dense_reference(folder, root / "int4_dense"), PROMPTS, MAX_NEW, device=device)
    rows: list[dict] = []

    def widened() -> dict:
        llm = LLM(str(folder), dtype="float32")
        return {"identical": greedy(llm, PROMPTS) == reference, "quantization": llm.runner.quantization}

    def four_bits() -> dict:
        llm = LLM(str(folder), dtype="bfloat16")
        out, eager = greedy(llm, PROMPTS), greedy(LLM(str(folder), dtype="bfloat16", enforce_eager=True), PROMPTS)
        graphs = llm.runner.decode_graphs
        return {"identical": out == eager, "quantization": llm.runner.quantization,
                "graph_steps": graphs.steps if graphs is not None else 0,
                "agreement_with_float32": f"{sum(a == b for a, b in zip(out, reference))}/{len(PROMPTS)}"}

    run_case(rows, {"model": "awq_llama", "case": "int4_widened_float32", "dtype": "float32"}, widened)
    run_case(rows, {"model": "awq_llama", "case": "int4_graphs_vs_eager", "dtype": "bfloat16"}, four_bits)
    return rows


def random_smollm2(assets: Path, dest: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(assets)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(dest, safe_serialization=True)
    for f in assets.iterdir():
        if f.name != "config.json":
            shutil.copy(f, dest / f.name)
    print(f"random SmolLM2-shaped model in {dest}", flush=True)


def check_device(cpu: bool) -> str | None:
    """Where the checks run: the GPU, or with `cpu` (--cpu, to test a script) the CPU; float32
    as float32 on both sides (no TF32). None where there is no GPU and no --cpu."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not cpu:
        print("no GPU: nothing to check (the CPU path is what CI tests)")
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return device


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".")
    parser.add_argument("--random-smollm2", nargs=2, metavar=("ASSETS", "DEST"))
    parser.add_argument("--cpu", action="store_true", help="run the checks on CPU (to test this script)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=DEFAULT_MODELS,
                        help="check these models only (the CPU test runs two: every case's code, in less time)")
    parser.add_argument("--only", nargs="+", choices=["greedy", "host_syncs", "structured", "int4", "fp8"],
                        default=["greedy", "host_syncs", "structured", "int4", "fp8"],
                        help="these kinds of check only (a short lease's rerun of the ones that failed)")
    args = parser.parse_args()
    if args.random_smollm2:
        random_smollm2(Path(args.random_smollm2[0]), Path(args.random_smollm2[1]))
        return 0
    device = check_device(args.cpu)
    if device is None:
        return 0
    import transformers
    import triton

    report = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "torch": torch.__version__,
              "triton": triton.__version__, "transformers": transformers.__version__, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models if "greedy" in args.only else ():
            arch, overrides = MODELS[name]
            report["rows"] += check_model(name, arch, overrides, Path(tmp), device)
        first = Path(tmp) / args.models[0]
        if not first.exists():
            arch, overrides = MODELS[args.models[0]]
            build_tiny_model(first, arch=arch, **overrides)
        if "host_syncs" in args.only:
            report["rows"] += check_host_syncs(first, device)
        if "structured" in args.only:
            report["rows"] += check_structured(first, device)
        if "int4" in args.only:
            report["rows"] += check_int4(Path(tmp), device)
    try:
        if "fp8" in args.only:
            report["rows"] += check_fp8(device)
    except Exception as exc:
        report["rows"].append({"case": "fp8_kernels", "identical": False, "error": repr(exc)})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1))
    failed = [r for r in report["rows"] if r.get("identical") is False or "error" in r]
    print(f"{len(report['rows']) - len(failed)}/{len(report['rows'])} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
