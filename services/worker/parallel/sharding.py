"""A rank's slice of the decoder (Megatron's layout, as vLLM shards it): q/k/v by heads
(a KV head on several ranks where there are fewer than ranks), o_proj's input by the same
heads, gate/up by their rows and down_proj's input by the same rows. o_proj and down_proj
then hold partial sums that one all-reduce a product adds. Norms, the embedding and the
LM head are whole on every rank, so every rank computes the same logits and samples the
same tokens (its sampler seeded alike).

The model is built from the rank's config (`local_config`: its heads and MLP rows), and
each checkpoint tensor is cut as it is read (`Shards.cut`), so no rank holds another's
slice of a layer."""

from __future__ import annotations

import dataclasses
import re

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.layers.moe import SparseMoE
from services.worker.models.decoder_config import ModelConfig

# Decoders whose layers are sharded as above; the rest are refused by what they have.
# (Quantized checkpoints are widened as they are read, before a tensor is cut: AWQ's,
# GPTQ's, FP8's, each rank its slice; 4-bit ones are quantized again to int4, each group
# of 32 inputs whole on one rank.)


def local_config(config: ModelConfig, world_size: int, expert_rank: int | None = None) -> ModelConfig:
    """The config of one rank's slice; a ValueError naming what cannot be sharded.
    `expert_rank`: with expert parallelism, this rank's (its experts whole, the
    num_experts / world_size of them from expert_rank's on; the shared expert sliced)."""
    arch = config.architecture
    if config.qk_norm_over_heads and config.num_key_value_heads % world_size:
        raise ValueError(f"--tensor-parallel-size {world_size}: {arch}'s key norm is over all of its "
                         f"{config.num_key_value_heads} KV heads, which do not split over {world_size} ranks")
    linear = _recurrent_slice(config, world_size) if config.recurrent_layers else {}
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    if heads % world_size:
        raise ValueError(f"--tensor-parallel-size {world_size}: {arch}'s {heads} attention heads do not split "
                         f"over {world_size} ranks")
    if kv_heads % world_size and world_size % kv_heads:
        raise ValueError(f"--tensor-parallel-size {world_size}: {arch}'s {kv_heads} KV heads neither split over "
                         f"{world_size} ranks nor repeat evenly across them")
    # (a sparse MLP: each rank a slice of every expert, as of a dense one, the router whole)
    sizes = {"intermediate_size": "MLP", "moe_intermediate_size": "experts' MLPs",
             "shared_expert_intermediate_size": "shared expert's MLP"}
    experts = ()
    if expert_rank is not None and config.num_experts:
        if config.num_experts % world_size:
            raise ValueError(f"--enable-expert-parallel: {arch}'s {config.num_experts} experts do not split over "
                             f"{world_size} ranks")
        per = config.num_experts // world_size
        experts, sizes = (expert_rank * per, per), {k: v for k, v in sizes.items() if k != "moe_intermediate_size"}
    for field, what in sizes.items():
        if getattr(config, field) % world_size:
            raise ValueError(f"--tensor-parallel-size {world_size}: {arch}'s {what} of {getattr(config, field)} "
                             f"does not split over {world_size} ranks")
    return dataclasses.replace(config, num_attention_heads=heads // world_size,
                               num_key_value_heads=max(1, kv_heads // world_size),
                               **{field: getattr(config, field) // world_size for field in sizes}, **linear,
                               local_experts=experts)


def _recurrent_slice(config: ModelConfig, world_size: int) -> dict:
    """A hybrid's recurrent mixer's fields for one rank: a Gated DeltaNet by key head (its
    value heads with it), a short convolution by channel, Mamba2 by head (B and C by group
    where the groups split, every rank's where there is one)."""
    arch, mixer = config.architecture, config.recurrent_mixer
    splits = {"gated_delta_net": ("linear_num_key_heads", "linear_num_value_heads"),
              "short_conv": ("short_conv_channels",), "mamba2": ("mamba_num_heads",)}[mixer]
    local = {}
    for field in splits:
        size = getattr(config, field) or config.hidden_size  # (short_conv_channels: 0 is every channel)
        if size % world_size:
            raise ValueError(f"--tensor-parallel-size {world_size}: {arch}'s {size} {mixer} heads or channels "
                             f"({field}) do not split over {world_size} ranks")
        local[field] = size // world_size
    if mixer == "mamba2" and config.mamba_num_groups > 1:
        if config.mamba_num_groups % world_size:
            raise ValueError(f"--tensor-parallel-size {world_size}: {arch}'s {config.mamba_num_groups} Mamba2 "
                             f"groups neither split over {world_size} ranks nor are one")
        local["mamba_num_groups"] = config.mamba_num_groups // world_size
    return local


_EXPERT = re.compile(r"\.experts\.(\d+)\.")  # a routed expert's weight (not a shared expert's)


class Shards:
    """Cuts checkpoint tensors, by name, to rank `rank` of `world_size`."""

    def __init__(self, full: ModelConfig, rank: int, world_size: int, local_experts: tuple = ()) -> None:
        self.full, self.rank, self.world_size = full, rank, world_size
        self.local_experts = local_experts  # (expert parallelism: the rank's experts, whole)

    def local_expert(self, index: int) -> int | None:
        """A checkpoint expert's index among this rank's; None: another rank's."""
        if not self.local_experts:
            return index
        first, count = self.local_experts
        return index - first if first <= index < first + count else None

    def expert_name(self, name: str) -> str | None:
        """A routed expert's checkpoint name with its index among this rank's; None: another
        rank's expert (not read here). Any other name as it is."""
        found = _EXPERT.search(name) if self.local_experts else None
        if found is None:
            return name
        local = self.local_expert(int(found.group(1)))
        return None if local is None else f"{name[:found.start(1)]}{local}{name[found.end(1):]}"

    def cut(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a checkpoint tensor (the whole of one every rank holds)."""
        if self.local_experts and _EXPERT.search(name):
            return tensor  # (expert parallelism: a routed expert is whole on its rank)
        if any(part in name for part in (".q_proj.", ".gate_proj.", ".up_proj.", ".q_b_proj.", ".kv_b_proj.",
                                         ".output_gate.")) or name.endswith(".self_attn.sinks"):
            # (latent attention's heads: their query rows and their rows of kv_b_proj; the
            # latent itself, kv_a_proj's, is every rank's, and so is its cache. A gate and a
            # sink a head, or a gate an output element: the rank's heads')
            return self._rows(tensor)
        if ".k_proj." in name or ".v_proj." in name:
            return self._kv_rows(tensor)
        if self.full.recurrent_mixer == "mamba2" and (".self_attn.in_proj." in name or ".conv1d." in name
                                                      or name.endswith((".self_attn.norm_weight", ".self_attn.D"))):
            return self._mamba2(name, tensor)
        if ".in_proj_qkv." in name or ".conv1d." in name:  # (a Gated DeltaNet's: its heads' q, k and v channels)
            full = self.full
            key_size = full.linear_num_key_heads * full.linear_key_head_dim
            q, k, v = tensor.split((key_size, key_size, full.linear_num_value_heads * full.linear_value_head_dim))
            return torch.cat((self._rows(q), self._rows(k), self._rows(v)))
        if self.full.recurrent_mixer == "short_conv" and (".self_attn.in_proj." in name or ".self_attn.conv." in name):
            # (LFM2's: its B, C and x gates' rows and the convolution's, the rank's channels)
            return torch.cat([self._rows(part) for part in tensor.chunk(3)]) if ".in_proj." in name else \
                self._rows(tensor)
        if any(part in name for part in (".in_proj_z.", ".in_proj_b.", ".in_proj_a.")) or \
                name.endswith((".dt_bias", ".A_log")):
            return self._rows(tensor)
        if ".o_proj." in name or ".down_proj." in name or ".out_proj." in name:
            # (their bias is whole: added once, by rank 0, after the sum: `split_sums`)
            return tensor.chunk(self.world_size, dim=1)[self.rank].contiguous() if tensor.dim() == 2 else tensor
        if self.full.qk_norm_over_heads and name.endswith((".q_norm.weight", ".k_norm.weight")):
            return self._rows(tensor)  # (OLMo 2's: a weight for each of the rank's heads' channels)
        if name.startswith(("model.embed_tokens.", "lm_head.")):
            return self._vocab_rows(tensor)
        if ".qkv_proj." in name:  # a checkpoint that fuses them (Phi-3): apart, cut, together again
            hd, full = self.full.head_dim, self.full
            q, k, v = tensor.split((full.num_attention_heads * hd, full.num_key_value_heads * hd,
                                    full.num_key_value_heads * hd))
            return torch.cat((self._rows(q), self._kv_rows(k), self._kv_rows(v)))
        if ".gate_up_proj." in name:
            if not self.full.gated_mlp:
                return self._rows(tensor)
            gate, up = tensor.chunk(2)
            return torch.cat((self._rows(gate), self._rows(up)))
        return tensor

    def cut_lora(self, fused: str, shard: int | None, a: torch.Tensor, b: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of a LoRA adapter's A [r, in] and B [out rows, r] for one shard
        of a fused module (lora/adapter.py; None: the whole module): B's rows as the base
        weight's are cut, or, where the module's input is split (o_proj, down_proj), A's
        columns (the shrunk activations are then summed over the ranks: layers/lora.py)."""
        if fused in ("o_proj", "down_proj"):
            return a.chunk(self.world_size, dim=1)[self.rank].contiguous(), b
        name = {("qkv_proj", 0): ".q_proj.", ("qkv_proj", 1): ".k_proj.", ("qkv_proj", 2): ".v_proj.",
                ("qkv_proj", None): ".qkv_proj.", ("gate_up_proj", 0): ".gate_proj.",
                ("gate_up_proj", 1): ".up_proj.", ("gate_up_proj", None): ".gate_up_proj."}[fused, shard]
        return a, self.cut(f"model.layers.0{name}lora_B", b)

    def whole_shape(self, name: str, shape: torch.Size) -> tuple[int, ...]:
        """The checkpoint's shape of an expert's product this rank holds `shape` of."""
        if self.local_experts:
            return tuple(shape)  # (expert parallelism: whole)
        if ".down_proj." in name:
            return shape[0], shape[1] * self.world_size
        return shape[0] * self.world_size, shape[1]

    def vocab_rows(self) -> tuple[int, int, int]:
        """(this rank's first row, its rows, every rank's rows): the vocabulary in equal
        slices, the last one's tail zero rows (never looked up, cut from the logits)."""
        per = -(-self.full.vocab_size // self.world_size)
        first = self.rank * per
        return first, max(0, min(per, self.full.vocab_size - first)), per

    def _vocab_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        first, rows, per = self.vocab_rows()
        out = tensor.new_zeros((per, *tensor.shape[1:]))
        out[:rows] = tensor[first:first + rows]
        return out

    def _mamba2(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Mamba2's in_proj rows (z, x, B, C, dt) and convolution channels (x, B, C): the
        rank's heads' z, x and dt, its groups' B and C (the one group: whole); its heads'
        skips and norm weights."""
        full = self.full
        inner, groups = full.mamba_num_heads * full.mamba_head_dim, full.mamba_num_groups * full.mamba_state_size
        if not (".in_proj." in name or ".conv1d." in name):
            return self._rows(tensor)
        sections = (inner, inner, groups, groups, full.mamba_num_heads) if ".in_proj." in name else \
            (inner, groups, groups)
        parts = tensor.split(sections)
        by_group = (2, 3) if ".in_proj." in name else (1, 2)
        return torch.cat([part if i in by_group and full.mamba_num_groups == 1 else self._rows(part)
                          for i, part in enumerate(parts)])

    def _rows(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.chunk(self.world_size)[self.rank].contiguous()

    def _kv_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        kv_heads = self.full.num_key_value_heads
        if kv_heads >= self.world_size:
            return self._rows(tensor)
        # Fewer KV heads than ranks: each rank keeps the head its query heads read.
        head = self.rank * kv_heads // self.world_size
        hd = self.full.head_dim
        return tensor[head * hd:(head + 1) * hd].contiguous()


class RowParallel(nn.Module):
    """A product over this rank's slice of its input: the ranks' partial sums added."""

    def __init__(self, inner: nn.Module, group) -> None:
        super().__init__()
        self.inner = inner
        self.group = group

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.inner.bias

    @property
    def input_split(self):
        """The group this product's inputs are split over (its LoRA's shrink sums over it)."""
        return self.group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x))


@torch.no_grad()
def split_sums(model: nn.Module, group) -> None:
    """After loading: o_proj and down_proj sum over the ranks, their bias added once; a
    sparse MLP's output summed once (its experts' and shared expert's partial sums, each
    weighed by the whole router's weights, add up in any order)."""
    for layer in model.model.layers:
        if isinstance(layer.mlp, SparseMoE):
            # (an expert whole on its rank adds its own bias: expert parallelism)
            routed = () if layer.mlp.expert_offset is not None else layer.mlp.experts
            for expert in (*routed, *filter(None, [layer.mlp.shared_expert])):
                _split_input(expert.down_proj, group)
            layer.mlp = RowParallel(layer.mlp, group)
        if getattr(layer.self_attn, "qk_norm_over_heads", False):
            attention = layer.self_attn
            attention.q_norm, attention.k_norm = SplitRMSNorm(attention.q_norm, group), \
                SplitRMSNorm(attention.k_norm, group)
        if hasattr(layer.self_attn, "norm_split") and model.shards.full.mamba_num_groups == 1:
            layer.self_attn.norm_split = group  # (Mamba2's one group: its output norm over every rank's heads)
        mixer = "out_proj" if hasattr(layer.self_attn, "out_proj") else "o_proj"  # (a Gated DeltaNet's: out_proj)
        for owner, name in ((layer.self_attn, mixer), (layer.mlp, "down_proj")):
            if owner is None or isinstance(owner, RowParallel):
                continue
            inner = getattr(owner, name)
            _split_input(inner, group)
            setattr(owner, name, RowParallel(inner, group))


def _split_input(linear: nn.Module, group) -> None:
    """A product whose input this rank holds a slice of: its bias added once, by rank 0
    (gpt-oss's experts' too: after the sum), and its inputs' group noted for quantization
    (quantized_linear.int8_grid: a channel's scale is the whole channel's)."""
    if linear.bias is not None and group.rank:
        linear.bias.zero_()
    linear.input_split = group


class SplitRMSNorm(nn.Module):
    """RMSNorm over a row split across the ranks (OLMo 2's query and key norms, over every
    head): each rank's sum of squares added over the ranks, then each rank weighs its part,
    in transformers' order (float32 statistics, the weight after the cast back)."""

    def __init__(self, norm: nn.Module, group) -> None:
        super().__init__()
        self.weight, self.eps, self.group = norm.weight, norm.eps, group
        self.size = norm.weight.shape[0] * group.world_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.float()
        squares = self.group.all_reduce(wide.pow(2).sum(-1, keepdim=True))
        normed = wide * torch.rsqrt(squares / self.size + self.eps)
        return self.weight * normed.to(x.dtype)


class VocabSlices(nn.Module):
    """The embedding by rows of the vocabulary (vLLM's VocabParallelEmbedding): each rank
    looks up the tokens in its rows (zero for the others'), and one all-reduce gives every
    rank every token's row; the LM head's logits, each rank's slice, put side by side."""

    def __init__(self, hidden_size: int, shards: Shards, group) -> None:
        super().__init__()
        self.first, self.rows, per = shards.vocab_rows()
        self.vocab_size, self.group = shards.full.vocab_size, group
        self.weight = nn.Parameter(torch.empty(per, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.first
        outside = (local < 0) | (local >= self.rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(logits) for _ in range(self.group.world_size)]
        self.group.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[..., :self.vocab_size]


def slice_vocabulary(model: nn.Module, shards: Shards, group) -> None:
    """Before loading: the embedding and an untied LM head made this rank's rows."""
    hidden = model.config.hidden_size
    model.model.embed_tokens = model.vocab_slices = VocabSlices(hidden, shards, group)
    if model.lm_head is not None:
        model.lm_head = nn.Linear(hidden, model.vocab_slices.weight.shape[0], bias=model.lm_head.bias is not None)
