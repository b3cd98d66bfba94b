"""What sampling costs a step apart from the model: `Sampler.sample` (and the copy of its
ids to the host) for each kind of request a client sends, at a few batch sizes, on SmolLM2's
own logits (transformers' forward over a chat: rows peaked and flat, as a model gives
them; how much of a row top-p keeps decides its cost) or random ones. On a CPU a decode
step of SmolLM2 is a few ms at batch 1, so a sampler's ms show in the inter-token latency
one for one.

    python scripts/sampler_times.py [--batch 1 16] [--logits model|random] [--device cpu|cuda] [--runs 3]

Prints one JSON line per batch size and run: the median ms of each kind, and each kind's
ratio to greedy's in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KINDS = {
    "greedy": {"temperature": 0.0},
    "temperature": {"temperature": 0.8},
    "seeded": {"temperature": 0.8, "seed": 7},
    "top_p": {"temperature": 0.8, "top_p": 0.95},
    "top_k": {"temperature": 0.8, "top_k": 40},
    "min_p": {"temperature": 0.8, "min_p": 0.05},
    "llama_cpp_defaults": {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05},
}


def time_kind(sampler, logits, states, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        sampler.sample(logits, states).to_host()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def model_logits() -> "torch.Tensor":
    """SmolLM2's logits [positions, 49152] at every position of one chat (a question and
    its answer), in bfloat16 (as the engine computes them), as float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmbus.model_fetch import resolve_model

    folder = resolve_model("smollm2")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    chat = [{"role": "user", "content": "Tell me about the sea, and a story about a dragon."},
            {"role": "assistant", "content": "The sea covers most of the Earth. Once upon a time a small dragon "
                                             "who loved tea lived by the shore, and every morning it flew over the "
                                             "waves to watch the fishing boats come home."}]
    ids = tokenizer(tokenizer.apply_chat_template(chat, tokenize=False), return_tensors="pt").input_ids
    with torch.inference_mode():
        return model(ids).logits[0].float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--logits", choices=["model", "random"], default="model")
    parser.add_argument("--vocab", type=int, default=49152, help="logits a row, for --logits random")
    parser.add_argument("--device", default="cpu", help="where the logits are (cuda: the GPU's sampler, its wait included)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=30, help="samples a kind, batch and run (the median is kept)")
    args = parser.parse_args()

    import torch

    from services.worker.request_state import RequestState
    from services.worker.sample.sampler import Sampler
    from shared.sampling_params import SamplingParams

    torch.set_num_threads(2)  # (the engine's on this 2-core machine)
    sampler = Sampler(seed=0)
    generator = torch.Generator().manual_seed(0)
    pool = model_logits() if args.logits == "model" else None
    for run in range(args.runs):
        for batch in args.batch:
            if pool is not None:  # rows of the model's, drawn afresh each run
                logits = pool[torch.randint(len(pool), (batch,), generator=generator)]
            else:  # bfloat16's values, as a model's logits come: ties and all
                logits = (torch.randn(batch, args.vocab, generator=generator) * 3).bfloat16().float()
            logits = logits.to(args.device)
            row = {"batch": batch, "vocab": logits.shape[-1], "logits": args.logits, "device": args.device, "run": run}
            for kind, fields in KINDS.items():
                states = [RequestState(req_id=str(i), token_ids=[1] * 600, num_prompt_tokens=512,
                                       sampling_params=SamplingParams(**fields), eos_token_id=2, block_row=i,
                                       num_computed_tokens=600) for i in range(batch)]
                row[f"{kind}_ms"] = round(time_kind(sampler, logits, states, args.repeats), 3)
            for kind in KINDS:
                row[f"{kind}_vs_greedy"] = round(row[f"{kind}_ms"] / row["greedy_ms"], 2)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
