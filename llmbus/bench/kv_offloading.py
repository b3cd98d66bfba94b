"""`llmbus bench kv-offloading`: what the host KV tier (--kv-offloading-size) saves a prompt
whose prefix was computed before. For each of --repeat fresh prefixes, in one process: the
prompt computed cold (its blocks stored to the tier), then asked again with the prefix
cache's pool cleared (`reset_prefix_cache`: the blocks come from the tier), then again with
them in the pool. Each is one token's generation, so its time is the prompt's TTFT. Prints
the medians, the tier's speed-up over recomputing, and whether the three gave one token
(the exit status says so); then the prompt's KV alone moved to shared memory and back
(`kv_move_ms`: what a hand-over between two workers of a host costs)."""

from __future__ import annotations

import argparse
import json
import statistics
import time


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix-len", type=int, default=1024, help="prompt tokens (random ids)")
    parser.add_argument("--repeat", type=int, default=3, help="prefixes, each timed cold, from the tier, pooled")


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from llmbus import LLM, SamplingParams
    from llmbus.cli.args import engine_kwargs
    from llmbus.model_fetch import DEFAULT_MODEL

    kwargs = engine_kwargs(args)
    if kwargs.get("kv_offloading_size") is None:
        kwargs["kv_offloading_size"] = 1.0
    llm = LLM(args.model, **kwargs)
    vocab = llm.tokenizer.hf.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    times: dict[str, list[float]] = {"cold": [], "tier": [], "pool": []}
    same = True
    rng = np.random.default_rng(args.seed)
    for _ in range(args.repeat):
        prompt = {"prompt_token_ids": rng.integers(0, vocab, args.prefix_len).tolist()}
        tokens = []
        for case in ("cold", "tier", "pool"):
            if case == "tier" and not llm.reset_prefix_cache():
                raise RuntimeError("the prefix cache could not be cleared (a request holds blocks)")
            start = time.perf_counter()
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            times[case].append(time.perf_counter() - start)
            tokens.append(out.outputs[0].token_ids)
        same = same and tokens[0] == tokens[1] == tokens[2]
    stats = llm.stats()
    # A prompt's KV moved through shared memory alone: its blocks to a tier of their own
    # and back into the same blocks (so the pool's bytes stay what they were), checksums
    # made and checked
    from services.worker.kv_tier import HostKVTier

    num_blocks = args.prefix_len // llm.runner.block_size
    # (made and used on the runner's thread, as a worker's tier is: once a second thread has
    # an OpenMP team of its own beside the runner's, these copies ran 2.5x slower here)
    scratch = llm.executor.call(HostKVTier, llm.runner.kv_caches, num_blocks * (1 << 24), None)
    orders = {block: block for block in range(num_blocks)}
    moves: dict[str, list[float]] = {"store": [], "load": [], "tcp_load": []}
    # The same load from another host's tier: its slots over TCP (loopback here), with a
    # one-time token, as a decode worker on another host loads a prompt prefilled elsewhere
    from shared.kv_transfer_tokens import sign
    from shared.messages import RemoteKVLoad

    address = llm.executor.call(scratch.serve, b"bench", "127.0.0.1")

    def over_tcp(orders):
        return scratch.load_remote(RemoteKVLoad(address, *sign(b"bench", address, list(orders.values())), orders))

    def timed(copy) -> tuple[float, object]:  # (on the runner's thread, as a worker copies: its OpenMP team's)
        start = time.perf_counter()
        result = copy(orders)
        return time.perf_counter() - start, result

    for _ in range(args.repeat):
        elapsed, _ = llm.executor.call(timed, scratch.store)
        moves["store"].append(elapsed)
        elapsed, bad = llm.executor.call(timed, scratch.load)
        moves["load"].append(elapsed)
        same = same and not bad
        elapsed, bad = llm.executor.call(timed, over_tcp)
        moves["tcp_load"].append(elapsed)
        same = same and not bad
    scratch.server.close()
    ms = {case: round(statistics.median(t) * 1e3, 2) for case, t in times.items()}
    print(json.dumps({
        "model": args.model or DEFAULT_MODEL, "dtype": kwargs.get("dtype"), "prefix_len": args.prefix_len, "repeat": args.repeat,
        "ttft_ms": ms, "tier_speedup_over_recompute": round(ms["cold"] / ms["tier"], 2),
        "pool_speedup_over_recompute": round(ms["cold"] / ms["pool"], 2),
        "kv_move_ms": {side: round(statistics.median(t) * 1e3, 2) for side, t in moves.items()},
        "kv_move_mb": round(num_blocks * scratch.slot_bytes / 1e6, 1),
        "external_prefix_cache_hits": stats.external_prefix_cache_hits, "same_tokens": same,
    }, indent=1))
    return 0 if same else 1
