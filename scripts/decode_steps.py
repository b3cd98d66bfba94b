"""Time the engine's decode steps at one batch size: the figures of the step table in
docs/performance/history.md, and a torch.profiler table with --profile.

    python scripts/decode_steps.py --batch 32 --dtype bfloat16 [--quantization int4]
        [--kv-cache-dtype fp8] [--prompt-len 128] [--profile]
        [--shape qwen3-0.6b | gemma-3-1b | olmo-2-1b] [--compare-one-call]

Each request has a 128-token prompt (--prompt-len) and 64 output tokens, all submitted at
once; steps that still prefill (the first ceil(batch * prompt / 2048)) are reported apart.
--shape runs random weights of a published model's shape (its config.json's numbers, with
SmolLM2's tokenizer and vocabulary; `load_format="dummy"`) where its checkpoint cannot be
fetched. --compare-one-call times the model's forward on decode steps with the CPU
kernels' one-call decoder layer and without it (the module path), alternating step by
step in one process, so the machine's drift falls on both alike.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from llmbus import LLM, SamplingParams
from llmbus.bench.latency import step_times
from llmbus.bench.workload import random_workload
from llmbus.model_fetch import resolve_model

OUTPUT, BUDGET = 64, 2048

# Published configs' shapes (their Hub config.json), on SmolLM2's vocabulary.
SHAPES = {
    "qwen3-0.6b": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "intermediate_size": 3072, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
                   "tie_word_embeddings": True},
    "gemma-3-1b": {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
                   "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
                   "intermediate_size": 6912, "rope_theta": 1000000, "rope_local_base_freq": 10000,
                   "sliding_window": 512, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
                   "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6, "tie_word_embeddings": True},
    "olmo-2-1b": {"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2", "hidden_size": 2048,
                  "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 16,
                  "intermediate_size": 8192, "rope_theta": 500000, "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
}


def shaped_folder(shape: str, dest: Path) -> Path:
    """SmolLM2's tokenizer and config with `shape`'s numbers: a folder for load_format="dummy"."""
    from gpu_figures import shaped_folder as smollm2_shaped  # (scripts/ is on the path when run as a script)

    return smollm2_shaped(resolve_model(None), dest, {**SHAPES[shape], "max_position_embeddings": 4096})


def compare_one_call(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[list[float], ...]:
    """Forward times of decode steps with the one-call layer and without, alternated."""
    model = llm.runner.model
    fused, forward = model.fused_decode, model.forward
    if fused is None:
        raise SystemExit("--compare-one-call: this model and dtype do not take the one-call decode layer")
    times: tuple[list[float], list[float]] = ([], [])

    def alternating(input_ids, positions, kv_caches, metadata):
        if not fused.takes(input_ids, metadata, kv_caches):
            return forward(input_ids, positions, kv_caches, metadata)
        side = len(times[0]) > len(times[1])  # 0: one call a layer, 1: the module path
        model.fused_decode = None if side else fused
        start = time.perf_counter()
        try:
            return forward(input_ids, positions, kv_caches, metadata)
        finally:
            times[side].append(time.perf_counter() - start)
            model.fused_decode = fused

    model.forward = alternating
    try:
        llm.generate(prompts, params)
    finally:
        model.forward = forward
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--profile", action="store_true", help="then profile 10 decode steps")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="random weights of this model's shape")
    parser.add_argument("--compare-one-call", action="store_true",
                        help="alternate the one-call decode layer and the module path, step by step")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = str(shaped_folder(args.shape, Path(tmp))) if args.shape else args.model
        run(args, LLM(model, dtype=args.dtype, quantization=args.quantization, max_num_batched_tokens=BUDGET,
                      kv_cache_dtype=args.kv_cache_dtype, kv_cache_memory_bytes=4 << 30,
                      load_format="dummy" if args.shape else "auto"))


def run(args: argparse.Namespace, llm: LLM) -> None:
    PROMPT = args.prompt_len
    requests = random_workload(args.batch, (PROMPT, PROMPT), (OUTPUT, OUTPUT), llm.runner.vocab_size)
    prompts = [r.prompt_token_ids for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=OUTPUT, ignore_eos=True)] * args.batch
    if args.compare_one_call:
        one_call, modules = (statistics.median(t) * 1e3 for t in compare_one_call(llm, prompts, params))
        print(f"{args.shape or args.model} {args.dtype} {args.quantization or ''} batch {args.batch}: decode forward "
              f"{one_call:.2f} ms with one call a layer, {modules:.2f} ms on the module path "
              f"(medians of alternated steps): {modules / one_call:.2f}x")
        return
    llm.add_requests(prompts, params)
    times = step_times(llm)
    num_prefill = -(-args.batch * PROMPT // BUDGET)
    print(f"{args.dtype} {args.quantization or ''} batch {args.batch}: prefill steps (ms) "
          f"{[round(t * 1e3) for t in times[:num_prefill]]}, decode median "
          f"{statistics.median(times[num_prefill:]) * 1e3:.1f} ms")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        llm.add_requests(prompts, params)
        for _ in range(num_prefill + 3):
            llm.step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(10):
                llm.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
