"""Speculative decoding's GPU figures (issue: speculation with models), measured in one run.

Random weights of real shapes (`load_format="dummy"`, drafters too): a Llama-3-8B-shaped
target in bfloat16 (SmolLM2's vocabulary, so its tokenizer serves), a Llama-3.2-1B-shaped
draft model of the same vocabulary, an EAGLE-3 head of the 8B's shape. Random drafts are
never right, so acceptance is pinned with vLLM's synthetic rejection sampling. One stream
(W0), the median time a token over `--tokens` tokens, each case against none in the same run:

- spec_token_ms_none: no speculation (CUDA graphs)
- spec_ratio_draft_model_len3: a draft model, k=3, synthetic acceptance length 3 (the
  issue's goal: <= 0.6x none; vLLM measured 0.57x)
- spec_ratio_draft_model_len1: the same at length 1 (every draft rejected): the draft
  path's overhead (goal <= 1.15x)
- spec_ratio_eagle3_len3: an EAGLE-3 head, k=3, length 3 (the target runs eager while a
  head reads its layers: what that costs shows here)

    python scripts/spec_gpu_figures.py --assets .gpu_assets/smollm2 --out $OUT

writes $OUT/spec_figures.json. `--cpu` runs it on tiny shapes on CPU (tests the script).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_figures import LLAMA3_8B, log, shaped_folder  # noqa: E402

LLAMA32_1B = {**LLAMA3_8B, "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 49152}


def eagle3_head(dest: Path, target: dict) -> Path:
    """An EAGLE-3 head's config for the target's shape (its weights: random, by load_format)."""
    dest.mkdir(parents=True, exist_ok=True)
    head = {key: target[key] for key in ("hidden_size", "intermediate_size", "num_attention_heads",
                                         "num_key_value_heads", "head_dim", "max_position_embeddings",
                                         "rope_theta", "rope_scaling", "rms_norm_eps", "vocab_size")
            if key in target}
    (dest / "config.json").write_text(json.dumps({**head, "architectures": ["LlamaForCausalLMEagle3"],
                                                  "model_type": "llama", "num_hidden_layers": 1,
                                                  "draft_vocab_size": target["vocab_size"]}))
    return dest


def token_ms(llm, tokens: int, rounds: int) -> float:
    """One stream's time a token: the median over `rounds` generations of `tokens` tokens
    (prefill excluded: a 1-token generation's time is taken off)."""
    from llmbus import SamplingParams

    prompt = [[1000 + i for i in range(64)]]

    def timed(n: int) -> float:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    timed(tokens)  # (warm-up)
    times = [(timed(tokens) - timed(1)) / (tokens - 1) * 1e3 for _ in range(rounds)]
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--assets", required=True, help="SmolLM2's config.json and tokenizer files")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu", action="store_true", help="tiny shapes on CPU (tests this script)")
    args = parser.parse_args()
    from llmbus import LLM

    if not args.cpu and not torch.cuda.is_available():
        print("no GPU: nothing to measure (--cpu tests the script)")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target_shape = TINY if args.cpu else {**LLAMA3_8B, "vocab_size": 49152}
    target = shaped_folder(Path(args.assets), out / "models" / "target", target_shape)
    draft = shaped_folder(Path(args.assets), out / "models" / "draft",
                          {**TINY, "num_hidden_layers": 1} if args.cpu else {**LLAMA32_1B, "vocab_size": 49152})
    head = eagle3_head(out / "models" / "eagle3", {**json.loads((target / "config.json").read_text())})
    tokens, rounds = (16, 1) if args.cpu else (args.tokens, args.rounds)
    report = {"device": torch.cuda.get_device_name() if not args.cpu else "cpu",
              "command": "python scripts/spec_gpu_figures.py --assets .gpu_assets/smollm2 --out $OUT"}
    cases = {
        "none": None,
        "draft_model_len3": {"method": "draft_model", "model": str(draft), "synthetic_acceptance_length": 3.0},
        "draft_model_len1": {"method": "draft_model", "model": str(draft), "synthetic_acceptance_length": 1.0},
        "eagle3_len3": {"method": "eagle3", "model": str(head), "synthetic_acceptance_length": 3.0},
    }
    for name, spec in cases.items():
        if spec is not None:
            spec = {**spec, "num_speculative_tokens": 3, "rejection_sample_method": "synthetic"}
        try:
            llm = LLM(str(target), dtype="bfloat16", load_format="dummy", speculative_config=spec,
                      max_model_len=1024)
            ms = token_ms(llm, tokens, rounds)
            stats = llm.stats()
            row = {"case": name, "token_ms": round(ms, 3)}
            if spec is not None:
                row["mean_acceptance_length"] = round(
                    1 + stats.spec_decode_num_accepted_tokens / max(1, stats.spec_decode_num_drafts), 3)
                row["ratio"] = round(ms / report["spec_token_ms_none"], 3)
                report[f"spec_ratio_{name}"] = row["ratio"]
                report[f"spec_acceptance_length_{name}"] = row["mean_acceptance_length"]
            else:
                report["spec_token_ms_none"] = row["token_ms"]
            del llm
        except Exception as exc:  # (one case failing keeps the others' figures)
            row = {"case": name, "error": f"{type(exc).__name__}: {exc}"}
            report[f"spec_error_{name}"] = row["error"]
        log(**row)
        (out / "spec_figures.json").write_text(json.dumps(report, indent=1))
        if "spec_token_ms_none" not in report:
            return 1
    return 0 if not any(k.startswith("spec_error_") for k in report) else 1


if __name__ == "__main__":
    raise SystemExit(main())
