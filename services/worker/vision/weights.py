"""An image encoder's tensors from the checkpoint into transformers' modules: each shape
checked against the config, every one the module needs found (a name the encoder maps
and the tower it goes to both name it: gemma3.py, qwen2_5_vl.py)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def copy_weights(module: torch.nn.Module, weights: Iterable[tuple[str, str, torch.Tensor]],
                 unused: Callable[[str], bool] | None = None) -> None:
    """`weights`: (checkpoint name, the module's name for it, tensor). `unused`: the module's
    names a family does not read (SigLIP's pooling head under Gemma 3): a checkpoint's
    tensor the module lacks is then skipped, and those may be missing; without it either
    is a ValueError naming the tensor."""
    params = module.state_dict()
    loaded = set()
    for name, local, tensor in weights:
        if local not in params:
            if unused is not None:
                continue
            raise ValueError(f"{name}: the image encoder has no such tensor")
        if params[local].shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)}, the config says {tuple(params[local].shape)}")
        params[local].copy_(tensor)
        loaded.add(local)
    missing = sorted(n for n in params if n not in loaded and not (unused is not None and unused(n)))
    if missing:
        raise ValueError(f"the checkpoint lacks the image encoder's {missing[0]} ({len(missing)} missing)")
