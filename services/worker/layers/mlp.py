"""The MLPs of the decoder's layers: gated (SiLU, GELU) and ungated (ReLU squared, GELU,
xIELU) with gate and up fused in one product, and gpt-oss's clamped SwiGLU experts."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import kernels.cpu as cpu_kernels
import kernels.elementwise as triton_kernels
from services.worker.layers.lora import LoRAStack, adapted

# The gate's activation for the MLPs that are not SwiGLU (Gemma's GeGLU), as transformers'
# ACT2FN names them, where the kernels do not take it (off the CPU, or GELU's exact form).
GATE_ACTS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
             "relu2": lambda x: F.relu(x).square(),  # (relu2: of an MLP without a gate, Arcee's)
             # GPT-2's and Phi's tanh form, as transformers computes it (not PyTorch's fused one:
             # the same function, other roundings)
             "gelu_new": lambda x: 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi)
                                                               * (x + 0.044715 * torch.pow(x, 3.0)))),
             "relu": F.relu}


class XIELU(nn.Module):
    """Apertus' xIELU activation (transformers' Python form): per layer, learned `alpha_p`
    and `alpha_n` (through softplus) and fixed `beta` and `eps`, all four read from the
    checkpoint as transformers saves them."""

    def __init__(self) -> None:
        super().__init__()
        for name in ("alpha_p", "alpha_n", "beta", "eps"):
            setattr(self, name, nn.Parameter(torch.zeros(1 if name.startswith("alpha") else ()), requires_grad=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p)
        alpha_n = self.beta + F.softplus(self.alpha_n)
        return torch.where(x > 0, alpha_p * x * x + self.beta * x,
                           (torch.expm1(torch.minimum(x, self.eps)) - x) * alpha_n + self.beta * x)


class MLP(nn.Module):
    """The dense gated MLP (SwiGLU, or GeGLU by `hidden_act`), and each expert of a sparse one."""

    def __init__(self, hidden_size: int, intermediate_size: int, triton: bool = False, hidden_act: str = "silu",
                 bias: bool = False, gated: bool = True):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.hidden_act = hidden_act
        self.gated = gated  # False (Arcee): gate_up_proj holds the up rows alone, down(act(up x))
        self.triton = triton and hidden_act == "silu"  # SiLU-and-mul in one Triton kernel (kernels/elementwise.py)
        self.gate_up_proj = nn.Linear(hidden_size, (2 if gated else 1) * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.shard_sizes = (intermediate_size, intermediate_size) if gated else (intermediate_size,)
        self.act_fn = XIELU() if hidden_act == "xielu" else GATE_ACTS[hidden_act]  # (a module: its parameters load)
        self.gate_up_lora: LoRAStack | None = None  # as Attention's
        self.down_lora: LoRAStack | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [num_tokens, hidden_size]
        gate_up = adapted(self.gate_up_proj, self.gate_up_lora, x)
        if not self.gated:
            return adapted(self.down_proj, self.down_lora, self.act_fn(gate_up))
        if self.triton and gate_up.is_contiguous():
            act = triton_kernels.silu_mul(gate_up)
        elif (self.hidden_act in cpu_kernels.ACTIVATIONS and cpu_kernels.supports(gate_up)
              and gate_up.is_contiguous()):
            act = cpu_kernels.act_and_mul(gate_up, self.hidden_act)  # one pass, the same roundings
        else:
            gate, up = gate_up.split(self.shard_sizes, dim=-1)
            act = GATE_ACTS[self.hidden_act](gate) * up
        return adapted(self.down_proj, self.down_lora, act)


class ClampedSwiGLUExpert(nn.Module):
    """gpt-oss's expert: biased products, and between them a SwiGLU with clamps, its gate
    at most `limit` and its up within +-`limit`, (up + 1) * gate * sigmoid(alpha * gate),
    as transformers computes it. `gate_up_proj` holds the gate rows, then the up rows (the
    checkpoint interleaves them: models/checkpoints/gpt_oss_weights.py reorders them at load)."""

    def __init__(self, hidden_size: int, intermediate_size: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=True)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=True)
        self.shard_sizes = (intermediate_size, intermediate_size)
        self.gate_up_lora: LoRAStack | None = None  # (adapters are refused for it: attribute for the loader's walk)
        self.down_lora: LoRAStack | None = None

    def activate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.shard_sizes, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activate(self.gate_up_proj(x)))
