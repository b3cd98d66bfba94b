"""`llmbus bench speculative`: the same workloads through `LLM` with and without
speculative decoding, in one process, alternating (off-on, on-off, ...) so the machine's
drift biases neither side; prints output tok/s for each, the ratio, and the acceptance
rate per draft position. Greedy: in float32 both sides generate the same tokens (the exit
status says whether they did); in bfloat16 near ties can flip, and it says how far they agree.

- `copy`: chat requests that ask the model to repeat a paragraph, one at a time (single
  stream), where prompt lookup pays most;
- `quote`: a long context and a question answered with a quote from it, one at a time;
- `w1`: W1's random-token prompts, all at once: traffic with nothing to copy, where
  speculation must cost next to nothing.
"""

from __future__ import annotations

import argparse
import json
import time

from llmbus.bench.workload import W1, random_workload

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


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", choices=["copy", "quote", "w1"], action="append",
                        help="repeatable; default: copy, quote and w1")
    parser.add_argument("--compare", default='{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 2}',
                        help="the speculative_config (JSON) to compare with none")
    parser.add_argument("--max-tokens", type=int, default=160, help="per copy/quote request")
    parser.add_argument("--repeat", type=int, default=2, help="pairs per workload, order alternating")
    parser.add_argument("--num-requests", type=int, default=W1["num_requests"], help="for w1")


def workload(name: str, tokenizer, args) -> tuple[list[list[int]], list[int], bool]:
    """Prompts, max_tokens each, and whether they run one at a time."""
    if name == "w1":
        reqs = random_workload(args.num_requests, tuple(W1["input_len"]), tuple(W1["output_len"]),
                               tokenizer.hf.vocab_size, args.seed)
        return [r.prompt_token_ids for r in reqs], [r.max_tokens for r in reqs], False
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


def run(args: argparse.Namespace) -> int:
    from llmbus import LLM
    from llmbus.cli.args import engine_kwargs

    kwargs = engine_kwargs(args)
    kwargs.pop("speculative_config", None)
    spec = json.loads(args.compare)
    engines = {"off": LLM(args.model, **kwargs), "on": LLM(args.model, speculative_config=spec, **kwargs)}
    same = True  # in float32, the check that speculation is exact
    for name in args.workload or ["copy", "quote", "w1"]:
        prompts, max_tokens, single = workload(name, engines["off"].tokenizer, args)
        time_s = {"off": 0.0, "on": 0.0}
        tokens = {"off": 0, "on": 0}
        before = engines["on"].stats()
        for i in range(args.repeat):
            outputs = {}
            for side in (["off", "on"] if i % 2 == 0 else ["on", "off"]):
                elapsed, outputs[side] = run_once(engines[side], prompts, max_tokens, single)
                time_s[side] += elapsed
                tokens[side] += sum(len(t) for t in outputs[side])
            same = same and (outputs["on"] == outputs["off"] or args.dtype != "float32")
        after = engines["on"].stats()
        drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        steps = after.spec_decode_num_drafts - before.spec_decode_num_drafts
        per_pos = [a - b for a, b in zip(after.spec_decode_num_accepted_tokens_per_pos,
                                         before.spec_decode_num_accepted_tokens_per_pos)]
        rate = {side: tokens[side] / time_s[side] for side in time_s}
        print(f"{name} ({'one at a time' if single else 'all at once'}, {len(prompts)} requests, "
              f"{args.repeat} pairs): off {rate['off']:.1f}, on {rate['on']:.1f} output tok/s -> "
              f"on/off {rate['on'] / rate['off']:.3f}; acceptance "
              f"{accepted / drafted if drafted else 0:.2f} of {drafted} drafts; per position "
              f"{', '.join(f'{n / steps:.2f}' for n in per_pos) if steps else '-'}; "
              f"{agreement(outputs['off'], outputs['on'])}")
    return 0 if same else 1


def agreement(a: list[list[int]], b: list[list[int]]) -> str:
    """Identical, or how far they agree: in bfloat16 a verify step's products (several rows
    a request) round differently from a decode's (one row), and a near tie can flip."""
    if a == b:
        return "outputs identical"
    common = sum(next((i for i, (x, y) in enumerate(zip(s, t)) if x != y), min(len(s), len(t))) for s, t in zip(a, b))
    return f"outputs agree on the first {common} of {sum(len(s) for s in a)} tokens (request by request)"
