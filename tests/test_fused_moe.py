"""kernels/fused_moe.py under Triton's interpreter: the alignment puts every (token, slot)
pair once in a block of its own expert, and the two grouped GEMMs give what the PyTorch
MoE path (one product per expert, layers/moe.py) gives, on small shapes."""

import pytest
import torch

from kernels.fused_moe import BLOCK_M, align_by_expert, fused_moe
from services.worker.layers.moe import SparseMoE
from services.worker.layers.mlp import MLP


@pytest.mark.parametrize("num_tokens, top_k, num_experts", [(1, 2, 8), (5, 2, 8), (40, 2, 8), (7, 1, 4), (9, 4, 4)])
def test_alignment_puts_each_pair_once_in_blocks_of_its_expert(num_tokens, top_k, num_experts):
    gen = torch.Generator().manual_seed(num_tokens)
    ids = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)])
    sorted_ids, block_experts = align_by_expert(ids, num_experts)
    num_pairs = num_tokens * top_k
    assert sorted_ids.numel() % BLOCK_M == 0 and block_experts.numel() == sorted_ids.numel() // BLOCK_M
    real = sorted_ids[sorted_ids < num_pairs]
    assert sorted(real.tolist()) == list(range(num_pairs))  # every pair once, the rest pads
    flat = ids.flatten()
    for block, expert in enumerate(block_experts.tolist()):
        pairs = sorted_ids[block * BLOCK_M : (block + 1) * BLOCK_M]
        pairs = pairs[pairs < num_pairs]
        if expert == num_experts:
            assert pairs.numel() == 0  # past the last expert's run: nothing
        else:
            assert (flat[pairs] == expert).all()
    used = block_experts[block_experts < num_experts].tolist()
    assert used == sorted(used)  # runs in expert order


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 33])
def test_grouped_gemms_match_the_per_expert_path(dtype, num_tokens):
    torch.manual_seed(num_tokens)
    hidden, inter, experts, top_k = 32, 48, 8, 2
    moe = SparseMoE(hidden, inter, experts, top_k, renormalize=True, expert=MLP)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    moe = moe.to(dtype)
    x = torch.randn(num_tokens, hidden).to(dtype)
    expected = moe(x)  # the PyTorch path: experts not stacked
    weights, chosen = moe.route(x)
    assert chosen.unique().numel() > 1  # several experts in play
    moe.stack_experts()
    got = fused_moe(x, moe.w_gate_up, moe.w_down, weights, chosen)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(moe(x), got)  # stacked: the module now takes the kernels
