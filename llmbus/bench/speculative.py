"""`llmbus bench speculative`: the same workloads through `LLM` without speculative
decoding and with each `--compare` config (n-gram, a draft model, ...), in one process,
alternating the order (off-a-b, b-a-off, ...) so the machine's drift biases no side;
prints output tok/s for each, its ratio to none, the acceptance rate, the mean acceptance
length (tokens a drafting step) and the rate per draft position. Greedy: in float32
every side generates the same tokens (the exit status says whether they did); in bfloat16
near ties can flip, and it says how far they agree.

- `copy`: chat requests that ask the model to repeat a paragraph, one at a time (single
  stream), where prompt lookup pays most;
- `quote`: a long context and a question answered with a quote from it, one at a time;
- `chat`: ordinary chat questions, one at a time (W0): nothing to copy, where only a
  model drafter can pay;
- `w1`: W1's random-token prompts, all at once: traffic with nothing to copy, where
  speculation must cost next to nothing.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from llmbus.bench.workload import W1, random_workload

QUESTIONS = ["Explain what a hash table is and when to use one.", "Write a short poem about the sea.",
             "What causes rain? Answer in a paragraph.", "Give three tips for someone learning Python.",
             "Describe the water cycle to a ten-year-old.", "Why is the sky blue?"]

PARAGRAPHS = [
    "The scheduler decides which requests run in each step under one token budget. Running "
    "requests come first, oldest first, and the newest is the first to be preempted when the "
    "cache is full. Waiting requests are admitted while there is room, and a long prompt is "
    "prefilled in chunks so that the decodes beside it keep their pace.",
    "Every worker holds a paged key-value cache: fixed-size blocks that a request's tokens "
    "fill in order. Blocks whose tokens are known are hashed, so a later request with the same "
    "prefix reuses them instead of computing them again, and a block nobody uses any more "
    "stays cached until the pool needs it for someone else.",
    "A gateway turns token ids into text with an incremental detokenizer per request, finds "
    "stop strings in the text, and sends each piece to the client as a server-sent event. When "
    "the client goes away, the gateway aborts the request at once, so the scheduler frees its "
    "blocks for the requests that are still waiting.",
]


DEFAULT_COMPARE = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=["copy", "quote", "chat", "w1"], action="append",
                        help="repeatable; default: copy, quote and w1")
    parser.add_argument("--compare", action="append",
                        help="a speculative_config (JSON) to compare with none; repeatable (each against none, in "
                        f"the same run); default: {DEFAULT_COMPARE}")
    parser.add_argument("--max-tokens", type=int, default=160, help="per copy/quote request")
    parser.add_argument("--repeat", type=int, default=2, help="pairs per workload, order alternating")
    parser.add_argument("--num-requests", type=int, default=W1["num_requests"], help="for w1")


def workload(name: str, tokenizer, args) -> tuple[list[list[int]], list[int], bool]:
    """Prompts, max_tokens each, and whether they run one at a time."""
    if name == "w1":
        reqs = random_workload(args.num_requests, tuple(W1["input_len"]), tuple(W1["output_len"]),
                               tokenizer.hf.vocab_size, args.seed)
        return [r.prompt_token_ids for r in reqs], [r.max_tokens for r in reqs], False
    if name == "chat":
        return [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS], \
            [args.max_tokens] * len(QUESTIONS), True
    prompts = []
    for i, paragraph in enumerate(PARAGRAPHS):
        if name == "copy":
            ask = f"Repeat this paragraph word for word:\n\n{paragraph}"
        else:
            context = "\n\n".join(PARAGRAPHS[i:] + PARAGRAPHS[:i])
            ask = f"{context}\n\nQuote, word for word, the paragraph above that explains the {['scheduler', 'cache', 'gateway'][i]}."
        prompts.append(tokenizer.apply_chat_template([{"role": "user", "content": ask}]))
    return prompts, [args.max_tokens] * len(prompts), True


def run_once(llm, prompts, max_tokens, one_at_a_time: bool) -> tuple[float, list[list[int]]]:
    from llmbus import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=False) for n in max_tokens]
    start = time.perf_counter()
    if one_at_a_time:
        outs = [llm.generate([p], [sp])[0] for p, sp in zip(prompts, params)]
    else:
        outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return elapsed, [o.outputs[0].token_ids for o in outs]


def label(spec: dict, taken: dict) -> str:
    """A side's name: its method and, for a drafter, its model's folder name."""
    name = spec["method"] + (f":{Path(spec['model']).name}" if spec.get("model") else "")
    return name if name not in taken else f"{name}#{len(taken)}"


def run(args: argparse.Namespace) -> int:
    from llmbus import LLM
    from llmbus.cli.args import engine_kwargs

    kwargs = engine_kwargs(args)
    kwargs.pop("speculative_config", None)
    engines = {"off": LLM(args.model, **kwargs)}
    for text in args.compare or [DEFAULT_COMPARE]:
        spec = json.loads(text)
        engines[label(spec, engines)] = LLM(args.model, speculative_config=spec, **kwargs)
    sides = list(engines)
    same = True  # in float32, the check that speculation is exact
    for name in args.workload or ["copy", "quote", "w1"]:
        prompts, max_tokens, single = workload(name, engines["off"].tokenizer, args)
        time_s, tokens = dict.fromkeys(sides, 0.0), dict.fromkeys(sides, 0)
        before = {side: engines[side].stats() for side in sides}
        for i in range(args.repeat):
            outputs = {}
            for side in (sides if i % 2 == 0 else sides[::-1]):
                elapsed, outputs[side] = run_once(engines[side], prompts, max_tokens, single)
                time_s[side] += elapsed
                tokens[side] += sum(len(t) for t in outputs[side])
            same = same and (all(outputs[s] == outputs["off"] for s in sides) or args.dtype != "float32")
        rate = {side: tokens[side] / time_s[side] for side in sides}
        print(f"{name} ({'one at a time' if single else 'all at once'}, {len(prompts)} requests, "
              f"{args.repeat} rounds): off {rate['off']:.1f} output tok/s")
        for side in sides[1:]:
            after, was = engines[side].stats(), before[side]
            drafted = after.spec_decode_num_draft_tokens - was.spec_decode_num_draft_tokens
            accepted = after.spec_decode_num_accepted_tokens - was.spec_decode_num_accepted_tokens
            steps = after.spec_decode_num_drafts - was.spec_decode_num_drafts
            per_pos = [a - b for a, b in zip(after.spec_decode_num_accepted_tokens_per_pos,
                                             was.spec_decode_num_accepted_tokens_per_pos)]
            print(f"  {side}: {rate[side]:.1f} output tok/s -> {rate[side] / rate['off']:.3f}x off; acceptance "
                  f"{accepted / drafted if drafted else 0:.2f} of {drafted} drafts, length "
                  f"{1 + accepted / steps if steps else 1:.2f} tokens a drafting step; per position "
                  f"{', '.join(f'{n / steps:.2f}' for n in per_pos) if steps else '-'}; "
                  f"{agreement(outputs['off'], outputs[side])}")
    return 0 if same else 1


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """Identical, or how far they agree: in bfloat16 a verify step's products (several rows
    a request) round differently from a decode's (one row), and a near tie can flip."""
    if a == b:
        return "outputs identical"
    common = sum(next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t))) for s, t in zip(a, b))
    return f"outputs agree on the first {common} of {sum(len(s) for s in a)} tokens (request by request)"
