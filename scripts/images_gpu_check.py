"""Images in, on a GPU: greedy output against transformers on the same GPU, for each family
that takes images (tiny random Gemma 3, Qwen2.5-VL, Qwen3-VL), plain and with chunked
prefill, in float32, where the output must equal transformers' token for token. On a GPU
the worker runs the Triton backend, its decode steps as CUDA graphs: Gemma 3's image
masks (a step with placeholders takes PyTorch's masked loop), the Qwen-VL families' MRoPE
rows (read by rotary_and_cache from the table's scratch rows), the encoders on the GPU.

    python scripts/images_gpu_check.py --out $OUT    # writes images_gpu_check.json; exit 1 on a mismatch
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import kernels  # noqa: E402, F401 - Triton's interpreter with --cpu, before triton loads
from gpu_check import check_device  # noqa: E402 - (this folder's: the script's own)

FAMILIES = {"gemma3": "gemma3_multimodal", "qwen2_5_vl": "qwen2_5_vl", "qwen3_vl": "qwen3_vl"}
ENGINES = {"plain": {}, "chunked": {"max_num_batched_tokens": 20, "long_prefill_token_threshold": 7}}


def check(family: str, root: Path, device: str, num_prompts: int | None = None) -> list[dict]:
    import test_images as cases
    from llmbus import LLM
    from tiny_models import build_tiny_model

    folder = build_tiny_model(root / family, FAMILIES[family], seed=3)
    prompts = (cases.PROMPTS if family == "gemma3" else cases.QWEN_PROMPTS)[:num_prompts]
    # (transformers' model on the same device)
    reference = (cases.hf_generate if family == "gemma3" else cases.hf_qwen_generate)(folder, prompts, device)
    rows = []
    for name, engine in ENGINES.items():
        try:  # (the Triton backend: a GPU's default, interpreted with --cpu)
            llm = LLM(str(folder), dtype="float32", device=device, attention_backend="triton", **engine)
            got = cases.generate_ids(llm, prompts)
            rows.append({"case": f"{family}/{name}", "identical": got == reference,
                         "prompts_equal": sum(a == b for a, b in zip(got, reference)), "prompts": len(prompts)})
            del llm
        except Exception as exc:  # noqa: BLE001 - a case's failure is its row's, the others run
            rows.append({"case": f"{family}/{name}", "identical": False, "error": repr(exc),
                         "traceback": traceback.format_exc()[-2000:]})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".")
    parser.add_argument("--cpu", action="store_true", help="run on CPU, the Triton backend interpreted (to test this)")
    parser.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES))
    parser.add_argument("--prompts", type=int, default=None, help="the first N test prompts only (default all)")
    args = parser.parse_args()
    device = check_device(args.cpu)
    if device is None:
        return 0
    report = {"gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu", "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families:
            report["rows"] += check(family, Path(tmp), device, args.prompts)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "images_gpu_check.json").write_text(json.dumps(report, indent=1))
    failed = [r for r in report["rows"] if not r["identical"]]
    print(f"{len(report['rows']) - len(failed)}/{len(report['rows'])} image checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
