"""A draft model cut from the target itself: its first N decoder layers, its embedding,
final norm and head (layer-skip self-drafting), as a model folder for
`--speculative-config '{"method": "draft_model", "model": OUT}'`. Where no trained draft
of a model's vocabulary is at hand (SmolLM2-135M is the smallest of its family), it gives
real drafts of the real model, hence a real acceptance rate to measure speculation by.

    python scripts/layer_skip_draft.py --model smollm2 --num-layers 8 --out /tmp/smollm2-8

The layers are copies (an N/L share of the target's decoder weights more in memory).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def cut(folder: Path, num_layers: int, out: Path) -> Path:
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = json.loads((folder / "config.json").read_text())
    if not 0 < num_layers < config["num_hidden_layers"]:
        raise SystemExit(f"--num-layers must be in [1, {config['num_hidden_layers'] - 1}]")
    out.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():  # tokenizer, templates, generation config: as the target's
        if path.is_file() and not path.name.endswith((".safetensors", ".bin")) and \
                path.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(path, out / path.name)
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                layer = _LAYER.search(name)
                if layer is None or int(layer.group(1)) < num_layers:
                    tensors[name] = f.get_tensor(name).clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for key in ("layer_types", "sliding_window_pattern"):  # (a per-layer list: the first N)
        if isinstance(config.get(key), list):
            config[key] = config[key][:num_layers]
    config["num_hidden_layers"] = num_layers
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a folder, or a name llmbus fetches")
    parser.add_argument("--num-layers", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    from llmbus.model_fetch import resolve_model

    print(cut(resolve_model(args.model), args.num_layers, args.out))


if __name__ == "__main__":
    main()
