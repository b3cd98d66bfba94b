"""Model layers: norms, rotary, and the forms a Linear takes on CPU (packed, quantized)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def replace_linears(model: nn.Module, build: Callable[[nn.Linear], nn.Module | None]) -> nn.Module:
    """Replace, in place, every plain nn.Linear under `model` with `build(linear)`; a
    linear for which `build` returns None stays."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and (replacement := build(child)) is not None:
                setattr(module, name, replacement)
    return model
