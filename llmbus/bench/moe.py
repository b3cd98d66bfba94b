"""`llmbus bench moe`: what the sparse MoE path (layers/moe.py) buys on a random-weight
Qwen3-MoE-shaped model small enough for a CPU (default: 4 layers, 8 experts, top 2), in one
run, alternating:

- `sparse`: llmbus as it runs MoE — tokens sorted by expert, one product per expert;
- `dense`: llmbus running every expert over every token and weighing the outputs by the
  router (zero for the experts a token did not pick): the same outputs, the upper bound of
  waste a sparse path must beat;
- `transformers`: transformers' own MoE forward on the same weights (its `generate`, static
  batches, as `llmbus bench throughput` runs it).

Two workloads: decode (one request, `--input-len` prompt tokens, the inter-token latency
of `--output-len` tokens) and W1 throughput (`--num-requests` random prompts). Prints the
figures, the ratios sparse/dense and sparse/transformers, and whether the float32 greedy
tokens agree between the three (the exit status).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from llmbus.bench.workload import W1, random_workload

SHAPE = {"hidden_size": 768, "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
         "num_hidden_layers": 4, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 768,
         "intermediate_size": 2048, "norm_topk_prob": True, "max_position_embeddings": 2048}
SMOKE = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_hidden_layers": 2, "moe_intermediate_size": 32, "intermediate_size": 64}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer-from", default=None,
                        help="a model folder whose tokenizer the random model takes (default: SmolLM2's)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128, help="decode workload: prompt tokens")
    parser.add_argument("--output-len", type=int, default=64, help="decode workload: tokens timed")
    parser.add_argument("--repeat", type=int, default=2, help="alternations of the three sides")
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and workloads, to test the bench itself")


# (torch is imported where it is used: every `llmbus` command imports this module)
def random_qwen3_moe(folder: Path, tokenizer_from: Path, shape: dict, seed: int) -> Path:
    """A Qwen3-MoE-shaped checkpoint with random weights and a real tokenizer."""
    import shutil

    import torch

    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    torch.manual_seed(seed)
    config = Qwen3MoeConfig(**shape, vocab_size=len(tokenizer), tie_word_embeddings=True,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    Qwen3MoeForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for extra in ("chat_template.jinja",):
        if (Path(tokenizer_from) / extra).is_file():
            shutil.copy(Path(tokenizer_from) / extra, folder / extra)
    return folder


def set_dense(llm, dense: bool) -> None:
    from services.worker.layers.moe import SparseMoE

    for module in llm.runner.model.modules():
        if isinstance(module, SparseMoE):
            module.dense = dense


def llmbus_decode(llm, prompt: list[int], n: int) -> tuple[float, list[int]]:
    """Seconds per token after the first, and the tokens."""
    from llmbus import SamplingParams

    def timed(tokens: int):
        start = time.perf_counter()
        out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start, out[0].outputs[0].token_ids

    first, _ = timed(1)
    whole, tokens = timed(n + 1)
    return (whole - first) / n, tokens


def hf_decode(model, prompt: list[int], n: int) -> tuple[float, list[int]]:
    import torch
    ids = torch.tensor([prompt])

    def timed(tokens: int):
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        return time.perf_counter() - start, out[0, len(prompt):].tolist()

    first, _ = timed(1)
    whole, tokens = timed(n + 1)
    return (whole - first) / n, tokens


def run(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from llmbus import LLM
    from llmbus.cli.args import engine_kwargs
    from llmbus.bench.throughput import run_llmbus, run_transformers
    from llmbus.model_fetch import resolve_model
    from services.worker.loader import parse_dtype

    shape = {**SHAPE, **(SMOKE if args.smoke else {})}
    num_requests = 4 if args.smoke else args.num_requests
    input_len, output_len = (16, 8) if args.smoke else (args.input_len, args.output_len)
    w1_in, w1_out = ((8, 32), (4, 16)) if args.smoke else (W1["input_len"], W1["output_len"])
    with tempfile.TemporaryDirectory(prefix="llmbus-moe-bench-") as tmp:
        folder = random_qwen3_moe(Path(tmp) / "qwen3-moe", resolve_model(args.tokenizer_from), shape, args.seed)
        # No prefix cache: every side runs the same prompts, and a later run would find the
        # earlier one's blocks (a first measurement of this bench was skewed that way).
        llm = LLM(str(folder), **{**engine_kwargs(args), "enable_prefix_caching": False})
        hf = AutoModelForCausalLM.from_pretrained(folder, dtype=parse_dtype(args.dtype)).eval()
        vocab = llm.runner.vocab_size
        prompt = random_workload(1, (input_len, input_len), (1, 1), vocab, seed=args.seed)[0].prompt_token_ids
        requests = random_workload(num_requests, w1_in, w1_out, vocab, seed=args.seed + 1)
        experts = shape["num_experts"]
        print(f"model: Qwen3-MoE-shaped, random weights, {shape['num_hidden_layers']} layers, {experts} experts, "
              f"top {shape['num_experts_per_tok']}, hidden {shape['hidden_size']}, expert width "
              f"{shape['moe_intermediate_size']}, dtype {args.dtype}, threads {torch.get_num_threads()}")
        itl: dict[str, list[float]] = {"sparse": [], "dense": [], "transformers": []}
        rate: dict[str, list[float]] = {"sparse": [], "dense": [], "transformers": []}
        tokens: dict[str, list[int]] = {}
        for r in range(args.repeat):
            sides = ["sparse", "dense", "transformers"] if r % 2 == 0 else ["transformers", "dense", "sparse"]
            for side in sides:
                if side == "transformers":
                    seconds, tokens[side] = hf_decode(hf, prompt, output_len)
                    result = run_transformers(folder, parse_dtype(args.dtype), requests, args.hf_batch_size)
                else:
                    set_dense(llm, side == "dense")
                    seconds, tokens[side] = llmbus_decode(llm, prompt, output_len)
                    result = run_llmbus(llm, requests)
                itl[side].append(seconds * 1e3)
                rate[side].append(result["output_tok_s"])
                print(json.dumps({"round": r, "side": side, "decode_itl_ms": round(seconds * 1e3, 2),
                                  "w1_output_tok_s": result["output_tok_s"]}), flush=True)
        set_dense(llm, False)
    summary = {side: {"decode_itl_ms": round(statistics.median(itl[side]), 2),
                      "w1_output_tok_s": round(statistics.median(rate[side]), 1)} for side in itl}
    for side, figures in summary.items():
        print(f"{side:>12}: decode {figures['decode_itl_ms']} ms/token, W1 {figures['w1_output_tok_s']} output tok/s")
    for other in ("dense", "transformers"):
        print(f"sparse/{other}: decode {summary[other]['decode_itl_ms'] / summary['sparse']['decode_itl_ms']:.2f}x faster, "
              f"W1 {summary['sparse']['w1_output_tok_s'] / summary[other]['w1_output_tok_s']:.2f}x the rate")
    same = tokens["sparse"] == tokens["dense"] == tokens["transformers"]
    print(f"decode tokens: sparse, dense and transformers {'agree' if same else 'differ'}")
    print(json.dumps(summary))
    return 0 if same or args.dtype != "float32" else 1
