"""The GPU worker's figures, measured in one run (issue: CUDA graphs, device sampling).

Random weights of real shapes (`load_format="dummy"`, nothing carried but configs and
SmolLM2's tokenizer): a SmolLM2-shaped model, and a Llama-3-8B-shaped one (SmolLM2's
vocabulary of 49152 so its tokenizer serves; the LM head is then 0.4 GB of the 15 GB).
Each figure with CUDA graphs (the default) and, where it is a ratio, against
`enforce_eager=True` in the same run:

- w0_itl_ms_smollm2_bf16: one request, the median decode step (offline W0's inter-token latency)
- w1_output_tok_s, w1_speedup_vs_eager: W1 (128 requests, 64-512 in, 32-256 out) through `LLM.generate`
- *_no_overlap, w1_overlap_speedup: the same with each step finished before the next is
  launched (`runner.overlap_steps = False`), so the host's work between steps shows
- gpu_busy_fraction_decode_b128: the GPU's kernel time in a batch-128 decode step (profiler)
  over the step's wall time (timed without the profiler: the median of three rounds, each
  in `decode_b128_step_ms_rounds`)
- gpu_busy_fraction_decode_b128_8b: the same share for the 8B shape's batch-128 step
- decode_b1_hbm_fraction_8b: the 8B shape's weight bytes a batch-1 decode step reads,
  over its step time, over the copy bandwidth measured here (bytes read + written a second)
- seeded_draws_same_as_cpu: the sampling contract's draws, bit for bit, on both devices
- fused_moe_ms_mixtral_layer_b{1,64}: one Mixtral-8x7B-shaped expert layer (8 experts of
  14336, top 2) as kernels/fused_moe.py's grouped GEMMs, against the per-expert PyTorch
  loop (`_loop`) on the same inputs, and the b1 run's share of the copy bandwidth

    python scripts/gpu_figures.py --assets .gpu_assets/smollm2 --out $OUT [--gpu-check $OUT/gpu_check.json]

writes $OUT/latest.json (docs/gpu/latest.json's shape) and prints each figure as it lands.
`--cpu` runs it on tiny shapes on CPU (tests/test_gpu_figures.py), eager against replay.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def log(**row) -> None:
    print(json.dumps(row), flush=True)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def shaped_folder(assets: Path, dest: Path, overrides: dict) -> Path:
    """SmolLM2's tokenizer and config, with the config's shape overridden."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in assets.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, dest / f.name)
    config = json.loads((assets / "config.json").read_text())
    config.update(overrides)
    if "hidden_activation" in overrides:  # Gemma's name for it: SmolLM2's hidden_act would be read first
        config.pop("hidden_act", None)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


# gpu_check's cases that check overlapped steps, not output against transformers.
OVERLAP_CASES = ("host_syncs", "host_waits")


def check_counts(rows: list[dict]) -> dict:
    """gpu_check.json's rows counted: greedy output against transformers (a model's cases,
    but the overlap checks), and every check (those and the float8 kernels' bytes too)."""
    rows = [r for r in rows if "identical" in r]
    greedy = [r for r in rows if r.get("model", "-") != "-" and r["case"] not in OVERLAP_CASES]
    return {"greedy_cases": len(greedy), "greedy_identical": sum(bool(r["identical"]) for r in greedy),
            "checks": len(rows), "checks_passed": sum(bool(r["identical"]) for r in rows)}


def _decode_batch(llm, batch: int, prompt_len: int, steps: int, salt: int) -> None:
    """`batch` requests prefilled and three decode steps in: the steps after are steady decodes."""
    from llmbus import RequestOutputKind, SamplingParams

    prompts = [[(salt * i + 13 * j) % 1000 + 20 for j in range(prompt_len)] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 10, ignore_eos=True,
                            output_kind=RequestOutputKind.FINAL_ONLY)  # (as generate asks)
    llm.add_requests(prompts, [params] * batch)
    while any(r.num_computed_tokens < prompt_len for r in llm.scheduler.requests.values()):
        llm.step()
    for _ in range(3):
        llm.step()


def _finish(llm) -> None:
    while llm.scheduler.has_unfinished_requests():
        llm.step()
    llm.step()


def decode_step_times(llm, batch: int, prompt_len: int, steps: int) -> list[float]:
    """Wall seconds between landed decode steps at `batch` requests, back to back (no sync
    between them: with steps overlapped, each step launches the next before it lands one,
    so the time between landings is the step's period), stepped as `generate` steps them."""
    from llmbus.bench.latency import step_times

    _decode_batch(llm, batch, prompt_len, steps, salt=7)
    sync()
    times = step_times(llm, steps)
    _finish(llm)
    return times


def gpu_busy_ms(llm, batch: int, prompt_len: int, steps: int) -> float:
    """The GPU's kernel time per decode step at `batch`, under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    _decode_batch(llm, batch, prompt_len, steps, salt=11)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            llm.step()
        sync()
    _finish(llm)
    events = prof.key_averages()
    print(events.table(sort_by="self_device_time_total", row_limit=12), flush=True)
    gpu_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return gpu_us / 1e3 / steps


def w1_rate(llm, vocab_size: int, num_requests: int) -> float:
    from llmbus import SamplingParams
    from llmbus.bench.workload import W1, random_workload

    requests = random_workload(num_requests, W1["input_len"], W1["output_len"], vocab_size, seed=0)
    params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def copy_bandwidth(device: str, num_bytes: int) -> float:
    """Bytes read + written a second by a device-to-device copy, best of five."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * num_bytes / best


def weight_bytes_per_decode_step(model) -> int:
    """Every parameter is read once a step, but the embedding: one row a token."""
    embed = model.model.embed_tokens.weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed or model.lm_head is None)


def moe_layer_times(device: str, tiny: bool) -> dict:
    """A Mixtral-8x7B-shaped sparse layer (bf16): fused grouped GEMMs against the loop."""
    from services.worker.layers.moe import SparseMoE
    from services.worker.layers.mlp import MLP

    hidden, inter = (64, 128) if tiny else (4096, 14336)
    with torch.device(device):
        moe = SparseMoE(hidden, inter, 8, 2, renormalize=True, expert=MLP)
    moe = moe.to(torch.bfloat16).requires_grad_(False)
    figures = {}
    for batch in (1, 64):
        x = torch.randn(batch, hidden, device=device, dtype=torch.bfloat16)
        for name in ("loop", "fused"):
            if name == "fused" and moe.w_gate_up is None:
                moe.stack_experts()
            with torch.inference_mode():
                for _ in range(3):
                    moe(x)
                sync()
                start = time.perf_counter()
                for _ in range(10):
                    moe(x)
                sync()
            ms = (time.perf_counter() - start) / 10 * 1e3
            figures[f"fused_moe_ms_mixtral_layer_b{batch}{'' if name == 'fused' else '_loop'}"] = round(ms, 3)
        moe.w_gate_up = moe.w_down = None  # the next batch's loop reads the experts again
    expert_bytes = sum(p.numel() * p.element_size() for p in moe.experts[0].parameters())
    figures["moe_b1_bytes_per_s"] = 2 * expert_bytes / (figures["fused_moe_ms_mixtral_layer_b1"] / 1e3)
    return figures


def seeded_draws_same_as_cpu(device: str) -> bool:
    from services.worker.sample.random_draws import uniform

    gen = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(1 << 62), 1 << 62, (4096,), generator=gen)
    positions = torch.randint(0, 1 << 20, (4096,), generator=gen)
    return torch.equal(uniform(seeds, positions), uniform(seeds.to(device), positions.to(device)).cpu())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--assets", required=True, help="SmolLM2's config.json and tokenizer files")
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpu-check", help="gpu_check.json, for the greedy cases")
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on CPU, replay for graphs (tests this script)")
    args = parser.parse_args()

    from llmbus import LLM

    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no GPU: nothing to measure (--cpu tests the script)")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "models"
    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49152}
    smol = shaped_folder(Path(args.assets), work / "smollm2", tiny if args.cpu else {})
    big = shaped_folder(Path(args.assets), work / "llama3-8b", tiny if args.cpu else {**LLAMA3_8B, "vocab_size": 49152})
    scale = 8 if args.cpu else 1  # fewer requests and steps on CPU

    def engine(folder: Path, eager: bool, **kwargs) -> LLM:
        llm = LLM(str(folder), dtype="bfloat16", load_format="dummy", enforce_eager=eager, **kwargs)
        if args.cpu and not eager:
            llm.runner.set_decode_graphs("replay")
        return llm

    report = {
        "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "command": "bash scripts/device_check.sh (python scripts/gpu_figures.py --assets .gpu_assets/smollm2 --out $OUT)",
        "torch": torch.__version__,
        "seeded_draws_same_as_cpu": seeded_draws_same_as_cpu(device),
    }
    log(seeded_draws_same_as_cpu=report["seeded_draws_same_as_cpu"])
    elementwise = out / "elementwise.json"  # scripts/elementwise_check.py's figures, run before this
    if elementwise.is_file():
        report.update(json.loads(elementwise.read_text()))
    host = out / "host_step_times.json"  # scripts/host_step_times.py's, run before this
    if host.is_file():
        for row in json.loads(host.read_text()):
            on = "_cuda" if row.get("device") == "cuda" else ""  # (the GPU's steps; else the forward on this CPU)
            report[f"host_ms_decode_b{row['batch']}{on}"] = row["host_ms"]
            report[f"wall_ms_decode_b{row['batch']}{on}"] = row["wall_ms"]
    report["triton_elementwise"] = os.environ.get("LLMBUS_TRITON_ELEMENTWISE", "1") != "0"
    if args.gpu_check and Path(args.gpu_check).is_file():
        report.update(check_counts(json.loads(Path(args.gpu_check).read_text())["rows"]))

    def save() -> None:  # after each figure, so a run cut short by its time limit keeps what it measured
        (out / "latest.json").write_text(json.dumps(report, indent=1) + "\n")

    start = time.perf_counter()
    graphs, eager = engine(smol, False, max_num_seqs=128), engine(smol, True, max_num_seqs=128)
    log(figure="engines_built", seconds=round(time.perf_counter() - start, 1))
    # Three modes: graphs with steps overlapped (the default), graphs with each step
    # finished before the next is launched (the overlap's share), eager (the graphs' share).
    modes = (("graphs", graphs, True, ""), ("no_overlap", graphs, False, "_no_overlap"), ("eager", eager, True, "_eager"))

    def each_mode():
        for name, llm, overlap, suffix in modes:
            llm.runner.overlap_steps = overlap
            yield name, llm, suffix
        graphs.runner.overlap_steps = True

    for name, llm, suffix in each_mode():
        itl = statistics.median(decode_step_times(llm, 1, 128, 64 // scale)) * 1e3
        report[f"w0_itl_ms_smollm2_bf16{suffix}"] = round(itl, 3)
        log(figure="w0_itl_ms", mode=name, value=round(itl, 3))
        save()
    # The batch-128 step in three rounds, the modes alternated: two runs on one lease once
    # gave 1.82 and 2.97 ms, so one round's median says too little about a noisy host.
    rounds: dict[str, list[float]] = {}
    for _ in range(3):
        for name, llm, suffix in each_mode():
            step = statistics.median(decode_step_times(llm, 128 // scale, 128, 20 // scale + 2))
            rounds.setdefault(suffix, []).append(round(step * 1e3, 3))
    report["decode_b128_step_ms_rounds"] = rounds
    for name, llm, suffix in each_mode():
        step_ms = statistics.median(rounds[suffix])
        busy = gpu_busy_ms(llm, 128 // scale, 128, 10 // scale + 1) if device == "cuda" else 0.0
        report[f"decode_b128_step_ms{suffix}"] = step_ms
        report[f"gpu_busy_fraction_decode_b128{suffix}"] = round(busy / step_ms, 3)
        log(figure="decode_b128", mode=name, step_ms=step_ms, rounds=rounds[suffix], gpu_busy_ms=round(busy, 3))
        save()
    rates = {}
    for _ in range(1 if args.cpu else 2):  # alternated, twice (once on CPU: there it tests the script)
        for name, llm, suffix in each_mode():
            rate = w1_rate(llm, 49152, 128 // scale // (2 if args.cpu else 1))
            rates.setdefault(suffix, []).append(rate)
            log(figure="w1_output_tok_s", mode=name, value=round(rate, 1))
    for suffix, values in rates.items():
        report[f"w1_output_tok_s{suffix}"] = round(max(values), 1)
    report["w1_speedup_vs_eager"] = round(max(rates[""]) / max(rates["_eager"]), 3)
    report["w1_overlap_speedup"] = round(max(rates[""]) / max(rates["_no_overlap"]), 3)
    save()
    del graphs, eager
    if device == "cuda":
        torch.cuda.empty_cache()

    # (KV for 128 requests of ~150 tokens: 2.5 GB at the 8B shape's 128 KB a token)
    llm = engine(big, False, max_num_seqs=128 // scale, max_cudagraph_capture_size=128 // scale,
                 kv_cache_memory_bytes=(4 << 30) if device == "cuda" else None)
    step = statistics.median(decode_step_times(llm, 1, 128, 40 // scale))
    weights = weight_bytes_per_decode_step(llm.runner.model)
    bandwidth = copy_bandwidth(device, (2 << 30) if device == "cuda" else (64 << 20))
    report["decode_b1_step_ms_8b"] = round(step * 1e3, 3)
    report["weight_gb_8b"] = round(weights / 1e9, 2)
    report["copy_bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
    report["decode_b1_hbm_fraction_8b"] = round(weights / step / bandwidth, 3)
    log(figure="decode_b1_8b", step_ms=report["decode_b1_step_ms_8b"], weight_gb=report["weight_gb_8b"],
        copy_gb_s=report["copy_bandwidth_gb_s"], hbm_fraction=report["decode_b1_hbm_fraction_8b"])
    # The same batch-128 step as the small model's: where the GPU's work outgrows the host's
    # per-request Python, the step is the GPU's (the small model's share is the host's).
    step = statistics.median(decode_step_times(llm, 128 // scale, 128, 12 // scale + 2))
    busy = gpu_busy_ms(llm, 128 // scale, 128, 6 // scale + 1) if device == "cuda" else 0.0
    report["decode_b128_step_ms_8b"] = round(step * 1e3, 3)
    report["gpu_busy_fraction_decode_b128_8b"] = round(busy / (step * 1e3), 3)
    log(figure="decode_b128_8b", step_ms=report["decode_b128_step_ms_8b"], gpu_busy_ms=round(busy, 3))
    save()
    if device == "cuda":
        del llm
        torch.cuda.empty_cache()
    moe = moe_layer_times(device, args.cpu)
    moe["moe_b1_hbm_fraction"] = round(moe.pop("moe_b1_bytes_per_s") / bandwidth, 3)
    report.update(moe)
    log(figure="fused_moe", **moe)
    shutil.rmtree(work, ignore_errors=True)
    save()
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
