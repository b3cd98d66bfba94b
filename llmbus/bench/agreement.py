"""`llmbus bench agreement`: how often a lower precision's greedy output equals float32's.

float32 is the reference (token-identical to transformers); bfloat16 rounds every
matmul input, so two nearly tied logits can swap and the texts part ways from there.
The figure that matters for a user is how often, and how late, that happens on real
prompts: both are printed, per prompt and in total.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

from shared.config import KV_CACHE_DTYPES

# Chat prompts of the kinds users send: facts, code, lists, arithmetic, open writing.
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that checks whether a number is prime.",
    "Explain photosynthesis to a ten-year-old.",
    "List three tips for a job interview.",
    "What is 17 times 23?",
    "Translate 'good morning, how are you?' into Spanish.",
    "Write a haiku about autumn.",
    "Why is the sky blue?",
    "Give me a recipe for pancakes.",
    "What are the planets of the solar system, in order?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "How do I reverse a list in JavaScript?",
    "What is the difference between a virus and a bacterium?",
    "Write a short email asking my manager for a day off.",
    "What causes earthquakes?",
    "Suggest a name for a coffee shop that sells books.",
]


@dataclass(slots=True)
class Agreement:
    prompts: int
    identical: int  # prompts whose whole output equals the reference
    tokens: int  # reference tokens compared
    matching_prefix_tokens: int  # summed over prompts: tokens before the first difference

    @property
    def identical_rate(self) -> float:
        return self.identical / self.prompts

    @property
    def prefix_rate(self) -> float:
        return self.matching_prefix_tokens / self.tokens


def compare(reference: list[list[int]], other: list[list[int]]) -> tuple[Agreement, list[int]]:
    prefixes = []
    for ref, out in zip(reference, other, strict=True):
        n = 0
        while n < min(len(ref), len(out)) and ref[n] == out[n]:
            n += 1
        prefixes.append(n)
    identical = sum(ref == out for ref, out in zip(reference, other))
    tokens = sum(len(ref) for ref in reference)
    return Agreement(len(reference), identical, tokens, sum(prefixes)), prefixes


def greedy_outputs(model: str, dtype: str, prompts: list[str], max_tokens: int, **engine) -> list[list[int]]:
    from llmbus import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    return [list(o.outputs[0].token_ids) for o in outputs]


def transformers_greedy(model: str, dtype: str, prompts: list[str], max_tokens: int) -> list[list[int]]:
    """The same prompts through transformers in that dtype, one at a time (no padding)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from services.worker.loader import parse_dtype

    tokenizer = AutoTokenizer.from_pretrained(model)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=parse_dtype(dtype)).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                return_tensors="pt", return_dict=True)["input_ids"]
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                              pad_token_id=tokenizer.eos_token_id)
            outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a local HF folder or a known model (default smollm2)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"],
                        help="compare quantized weights (with --dtype activations; int8 needs bfloat16)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="compare an 8-bit float KV cache (with --dtype activations and weights)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--skip-hf", action="store_true",
                        help="skip the same comparison for transformers (which tells precision from bugs)")


def run(args: argparse.Namespace) -> int:
    from llmbus.model_fetch import resolve_model

    path = str(resolve_model(args.model))
    reference = greedy_outputs(path, "float32", PROMPTS, args.max_tokens)
    other = greedy_outputs(path, args.dtype, PROMPTS, args.max_tokens, quantization=args.quantization,
                           kv_cache_dtype=args.kv_cache_dtype)
    agreement, prefixes = compare(reference, other)
    label = f"{args.quantization} ({args.dtype})" if args.quantization else args.dtype
    if args.kv_cache_dtype != "auto":
        label += f", {args.kv_cache_dtype} KV cache"
    print(f"{label} vs float32, greedy, {agreement.prompts} chat prompts, up to {args.max_tokens} tokens each")
    for prompt, ref, n in zip(PROMPTS, reference, prefixes):
        print(f"  {'same' if n == len(ref) else f'differs at token {n}':>20}  {prompt}")
    print(f"identical outputs: {agreement.identical}/{agreement.prompts} ({agreement.identical_rate:.0%}); "
          f"tokens before the first difference: {agreement.matching_prefix_tokens}/{agreement.tokens} "
          f"({agreement.prefix_rate:.0%})")
    result = {"dtype": label, "identical": agreement.identical, "prompts": agreement.prompts,
              "matching_prefix_tokens": agreement.matching_prefix_tokens, "tokens": agreement.tokens}
    if not (args.skip_hf or args.quantization or args.kv_cache_dtype != "auto"):
        # The same question for transformers: its float32 is our reference token for token,
        # so its lower precision should part from it about as often as ours does.
        hf, _ = compare(reference, transformers_greedy(path, args.dtype, PROMPTS, args.max_tokens))
        print(f"transformers {args.dtype} vs float32: identical {hf.identical}/{hf.prompts} ({hf.identical_rate:.0%}); "
              f"tokens before the first difference: {hf.matching_prefix_tokens}/{hf.tokens} ({hf.prefix_rate:.0%})")
        result["transformers"] = {"identical": hf.identical, "matching_prefix_tokens": hf.matching_prefix_tokens}
    print(json.dumps(result))
    return 0
