"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE) for the CPU and PyTorch paths.

The router scores every token against every expert (softmax in float32, as transformers
does), keeps the top k, and weighs them by their share of the softmax (renormalized over
the k chosen, or not: `norm_topk_prob`). Tokens are then sorted by expert and each expert
runs one product over all of its tokens — a Python loop over experts, never over tokens —
its output weighed and added back into the tokens' rows in expert order, the order
transformers adds them in, so float32 outputs keep its bits as far as the products do.

Each expert is the dense model's MLP (`gate_up_proj`, `down_proj`), so the CPU kernels'
packed products, int8 and int4 take the experts as they take any layer. The router is a
plain weight, not an nn.Linear: quantizing it would move which experts a token picks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, expert: type[nn.Module]) -> None:
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Router(num_experts, hidden_size)
        self.experts = nn.ModuleList(expert(hidden_size, intermediate_size) for _ in range(num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [num_tokens, k] in x's dtype, experts [num_tokens, k]) of each token."""
        probs = F.linear(x, self.gate.weight).softmax(-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        weights, chosen = self.route(x)
        flat = chosen.flatten()  # (token, slot) pairs, token-major
        order = torch.argsort(flat, stable=True)  # the pairs grouped by expert
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        pair_weights = weights.flatten()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(self.experts, counts):
            if not count:
                continue
            pairs = order[start : start + count]
            start += count
            tokens = pairs // self.top_k
            out.index_add_(0, tokens, expert(x[tokens]) * pair_weights[pairs, None])
        return out
