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

Qwen2-MoE adds a shared expert: a dense MLP every token takes, its output weighed by
sigmoid(shared_expert_gate . x) and added to the routed experts' (its gate, one row, kept
unquantized as the router is). GLM-4.5's shared experts are added unweighed.

GLM-4.5's router is DeepSeek-V3's (`CorrectedRouter` below): sigmoid scores, the choice
made on the scores plus a learned correction bias among the best groups of experts, the
chosen experts weighed by their plain scores, renormalized and scaled. ERNIE 4.5's is the
same over softmax probabilities, without groups or scaling.

With the Triton backend the experts' weights are stacked once at load ([E, N, K], each
expert's weight then a view of it) and the products run as kernels/fused_moe.py's two
grouped GEMMs, with no host read: what a CUDA graph can capture.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, bias: bool = False, float32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None  # (gpt-oss's)
        # Hunyuan MoE's router weighs tokens in float32 whatever the model's dtype, as
        # transformers' HunYuanMoEV1Gate does (its `wg` kept float32): in bfloat16 the
        # model's dtype moved near-tied choices of experts
        self.float32 = float32
        self.weight.keep_float32 = float32


class CorrectedRouter(Router):
    """Experts chosen by their scores plus a learned correction bias, weighed by the scores
    alone, in float32: DeepSeek-V3's (sigmoid scores, groups, scaled: transformers'
    Glm4MoeTopkRouter) or ERNIE 4.5's (softmax, its sum floored at `norm_min`:
    Ernie4_5_MoeTopKRouter); with `corrected` off, DeepSeek-V2's (softmax scores alone,
    groups ranked by their best expert with `group_by_max`, scaled: DeepseekV2TopkRouter)."""

    def __init__(self, num_experts: int, hidden_size: int, scoring: str, num_groups: int = 1, topk_groups: int = 1,
                 scaling: float = 1.0, norm_min: float = 0.0, float32: bool = False, corrected: bool = True,
                 group_by_max: bool = False, norm_eps: float = 1e-20) -> None:
        # ERNIE's weights stay float32 (transformers' Ernie4_5_MoeTopKRouter keeps them);
        # DeepSeek's take the model's dtype, as transformers casts them (products in float32 all)
        super().__init__(num_experts, hidden_size, float32=float32)
        # A buffer: it stays float32 whatever the model's dtype (transformers keeps it so)
        if corrected:
            self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        else:
            self.e_score_correction_bias = None
        self.scoring, self.num_groups, self.topk_groups = scoring, num_groups, topk_groups
        self.scaling, self.norm_min, self.group_by_max = scaling, norm_min, group_by_max
        self.norm_eps = norm_eps  # (added to the renormalizing sum: DeepSeek-V3's 1e-20, LFM2-MoE's 1e-6)

    def route(self, x: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if self.scoring == "sigmoid" else logits.softmax(-1)
        choice = scores if self.e_score_correction_bias is None else scores + self.e_score_correction_bias
        if self.topk_groups < self.num_groups:  # only the experts of the best groups (a group by its two best)
            grouped = choice.unflatten(-1, (self.num_groups, -1))  # [tokens, groups, experts a group]
            rank = grouped.amax(-1) if self.group_by_max else grouped.topk(2, dim=-1).values.sum(-1)
            best = rank.topk(self.topk_groups, dim=-1).indices
            kept = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).flatten(1)
        chosen = choice.topk(top_k, dim=-1).indices
        weights = scores.gather(1, chosen)
        if renormalize:
            total = weights.sum(-1, keepdim=True)
            weights = weights / (total.clamp(min=self.norm_min) if self.norm_min else total + self.norm_eps)
        return (weights * self.scaling if self.scaling != 1.0 else weights).to(x.dtype), chosen


class SparseMoE(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int,
                 renormalize: bool, expert: type[nn.Module], fused: bool = False, topk_softmax: bool = False,
                 shared_intermediate_size: int = 0, router_bias: bool = False, shared_gated: bool = True,
                 router: Router | None = None, router_float32: bool = False, local_experts: tuple = ()) -> None:
        """`local_experts`: (first, count) of the `num_experts` the router picks from that
        this rank holds, with expert parallelism; () for all of them."""
        super().__init__()
        self.top_k = top_k
        self.renormalize = renormalize
        self.topk_softmax = topk_softmax  # GraniteMoe's (and gpt-oss's): a softmax over the k chosen logits
        self.gate = router if router is not None else Router(
            num_experts, hidden_size, router_bias, router_float32)
        # (expert parallelism: the first of this rank's experts; a token's pick of another
        # rank's adds nothing here, the ranks' outputs summed after: sharding.split_sums)
        self.expert_offset = local_experts[0] if local_experts else None
        held = local_experts[1] if local_experts else num_experts
        self.experts = nn.ModuleList(expert(hidden_size, intermediate_size) for _ in range(held))
        self.shared_expert = expert(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        self.shared_expert_gate = Router(1, hidden_size) if shared_intermediate_size and shared_gated else None
        self.fused = fused  # the Triton grouped GEMMs, once `stack_experts` has run
        # Every expert over every token, weighed by the router (zero where not picked): the
        # same outputs at the cost a sparse path must beat (`llmbus bench moe` only).
        self.dense = False
        self.w_gate_up: torch.Tensor | None = None  # [E, 2 * intermediate, hidden]
        self.w_down: torch.Tensor | None = None  # [E, hidden, intermediate]
        self.b_gate_up: torch.Tensor | None = None  # [E, 2 * intermediate] (gpt-oss's biases)
        self.b_down: torch.Tensor | None = None  # [E, hidden]
        self.activate = None  # the experts' own gate (gpt-oss's), or None: SiLU-and-mul

    @torch.no_grad()
    def stack_experts(self) -> None:
        """The experts' weights as two stacked tensors, each expert's now a view of them
        (no second copy). After the weights reached their dtype and device."""
        gate_up = torch.stack([e.gate_up_proj.weight.data for e in self.experts])
        down = torch.stack([e.down_proj.weight.data for e in self.experts])
        for i, e in enumerate(self.experts):
            e.gate_up_proj.weight.data, e.down_proj.weight.data = gate_up[i], down[i]
        self.w_gate_up, self.w_down = gate_up, down
        first = self.experts[0]
        if first.gate_up_proj.bias is not None:  # gpt-oss's biased experts, their gate its own
            self.b_gate_up = torch.stack([e.gate_up_proj.bias.data for e in self.experts])
            self.b_down = torch.stack([e.down_proj.bias.data for e in self.experts])
            for i, e in enumerate(self.experts):
                e.gate_up_proj.bias.data, e.down_proj.bias.data = self.b_gate_up[i], self.b_down[i]
        self.activate = getattr(first, "activate", None)  # None: SiLU-and-mul

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [num_tokens, k] in x's dtype, experts [num_tokens, k]) of each token."""
        if isinstance(self.gate, CorrectedRouter):
            return self.gate.route(x, self.top_k, self.renormalize)
        if self.topk_softmax:
            top, chosen = F.linear(x, self.gate.weight, self.gate.bias).float().topk(self.top_k, dim=-1)
            return top.softmax(-1).to(x.dtype), chosen
        logits = F.linear(x.float(), self.gate.weight) if self.gate.float32 else F.linear(x, self.gate.weight)
        probs = logits.softmax(-1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        routed = self.routed(x)
        if self.shared_expert is None:
            return routed
        if self.shared_expert_gate is None:  # (GLM-4.5's: unweighed)
            return routed + self.shared_expert(x)
        return routed + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * self.shared_expert(x)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        """The k chosen experts' outputs, weighed by the router (with expert parallelism,
        those of the chosen experts this rank holds)."""
        weights, chosen = self.route(x)
        held = len(self.experts)
        if self.expert_offset is not None:
            # Another rank's pick: weight 0 on this rank's first expert (the grouped GEMMs
            # compute it; the loop below skips it).
            chosen = chosen - self.expert_offset
            mine = (chosen >= 0) & (chosen < held)
            weights, chosen = weights * mine, torch.where(mine, chosen, 0)
        if self.w_gate_up is not None:
            from kernels.fused_moe import fused_moe  # Triton: only where its backend runs

            return fused_moe(x, self.w_gate_up, self.w_down, weights, chosen, self.b_gate_up, self.b_down,
                             self.activate)
        if self.dense:
            combine = torch.zeros(x.shape[0], held, dtype=x.dtype, device=x.device)
            combine.scatter_add_(1, chosen, weights)  # (another rank's picks add 0 to expert 0)
            out = torch.zeros_like(x)
            for i, expert in enumerate(self.experts):
                out += expert(x) * combine[:, i : i + 1]
            return out
        flat = chosen.flatten()  # (token, slot) pairs, token-major
        if self.expert_offset is not None:  # (another rank's picks: past the last expert, never run)
            flat = torch.where(mine.flatten(), flat, held)
        order = torch.argsort(flat, stable=True)  # the pairs grouped by expert
        counts = torch.bincount(flat, minlength=held).tolist()
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
