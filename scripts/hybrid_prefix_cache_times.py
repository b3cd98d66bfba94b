"""What the prefix cache buys a hybrid model (services/scheduler/core/state_snapshots.py): a
Qwen3.5-shaped model (random weights; 8 layers of 512, 6 of them Gated DeltaNet) answers
16 requests that share a 1024-token system prompt, each with its own 64-token question,
16 tokens out: one request first (its time: what a miss costs, its prefill cut at its
last block boundary and its state saved there), then the other 15 at once. The prefix
cache on against off, alternated, in one run.

    python scripts/hybrid_prefix_cache_times.py [--rounds 3] [--fresh]

--fresh: a new system prompt each round (the 15 find the state that the first of them
to see the shared blocks saved where those end); without it, the same prompt every round
(from the second round on, the prefix's state is cached before the round starts).
Prints one JSON line per round and setting.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--fresh", action="store_true", help="a new system prompt each round")
    args = parser.parse_args()

    from llmbus import LLM, SamplingParams
    from tiny_models import build_tiny_model, random_prompts

    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_model(Path(tmp) / "qwen3_5", "qwen3_5", seed=2, hidden_size=512, intermediate_size=1024,
                                  num_hidden_layers=8, vocab_size=2048, max_position_embeddings=4096)
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        engines = {on: LLM(str(folder), enable_prefix_caching=on, max_num_seqs=16) for on in (True, False)}
        for round_ in range(args.rounds):
            for on, llm in engines.items():
                system = random_prompts([1024], seed=1 + (round_ if args.fresh else 0))[0]
                prompts = [system + q for q in random_prompts([64] * 16, seed=100 + 2 * round_ + on)]
                start = time.perf_counter()
                llm.generate(prompts[:1], params, use_tqdm=False)
                first = time.perf_counter() - start
                start = time.perf_counter()
                outputs = llm.generate(prompts[1:], params, use_tqdm=False)
                rest = time.perf_counter() - start
                print(json.dumps({"round": round_, "prefix_caching": on, "first_s": round(first, 3),
                                  "rest_15_s": round(rest, 3),
                                  "cached_tokens": sum(o.num_cached_tokens for o in outputs)}), flush=True)


if __name__ == "__main__":
    main()
