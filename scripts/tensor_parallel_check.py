"""A real checkpoint with --tensor-parallel-size N against transformers: greedy output
token for token on three prompts (a completion, code, a chat turn; chunked prefill forced).
What tests/test_tensor_parallel.py does with tiny models, for a model too slow for CI.

    python scripts/tensor_parallel_check.py --model smollm2 --tensor-parallel-size 3
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a folder, or a name llmbus fetches (default: smollm2)")
    parser.add_argument("--tensor-parallel-size", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    from llmbus import LLM, SamplingParams
    from llmbus.model_fetch import resolve_model
    from tiny_models import hf_greedy

    path = resolve_model(args.model)
    start = time.perf_counter()
    llm = LLM(str(path), tensor_parallel_size=args.tensor_parallel_size, max_num_batched_tokens=64)
    started = time.perf_counter() - start
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Write one sentence about the sea."}])
    prompts = [llm.tokenizer.encode("The capital of France is"), llm.tokenizer.encode("def fibonacci(n):"), chat]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    generated = time.perf_counter() - start - started
    expected = hf_greedy(Path(path), prompts, args.max_tokens)
    equal = [g == e for g, e in zip(got, expected)]
    print(json.dumps({"model": str(args.model), "tensor_parallel_size": args.tensor_parallel_size,
                      "equal_to_transformers": equal, "start_s": round(started, 1),
                      "generate_s": round(generated, 1)}))
    return 0 if all(equal) else 1


if __name__ == "__main__":
    raise SystemExit(main())
