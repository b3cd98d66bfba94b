"""The corrected routers (services/worker/layers/moe.py `CorrectedRouter`) against
transformers' own on the same weights: DeepSeek-V3's as GLM-4.5 runs it (sigmoid scores,
groups, renormalized or not, scaled) and ERNIE 4.5's (softmax, its floor), over random
tokens, empty batches included."""

import pytest
import torch

from services.worker.layers.moe import CorrectedRouter, SparseMoE


def same_choice(ours, theirs_weights, theirs_chosen):
    """The same experts with the same weights, whatever order each lists them in."""
    weights, chosen = ours
    order, theirs_order = chosen.argsort(-1), theirs_chosen.argsort(-1)
    assert torch.equal(chosen.gather(-1, order), theirs_chosen.gather(-1, theirs_order))
    torch.testing.assert_close(weights.gather(-1, order), theirs_weights.gather(-1, theirs_order), rtol=0, atol=0)


@pytest.mark.parametrize("groups, kept, norm, scaling", [(1, 1, True, 1.0), (4, 2, True, 2.5), (4, 1, False, 1.5),
                                                         (8, 3, True, 1.0)])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_deepseek_v3_routing_equals_glm4_moe_s(groups, kept, norm, scaling, tokens):
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = Glm4MoeConfig(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=groups, topk_group=kept,
                           norm_topk_prob=norm, routed_scaling_factor=scaling)
    theirs = Glm4MoeTopkRouter(config)
    ours = CorrectedRouter(16, 32, "sigmoid", groups, kept, scaling)
    gen = torch.Generator().manual_seed(groups * 100 + tokens)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(16, 32, generator=gen))
        theirs.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.5)
        ours.weight.copy_(theirs.weight)
        ours.e_score_correction_bias.copy_(theirs.e_score_correction_bias)
        x = torch.randn(tokens, 32, generator=gen)
        _, weights, chosen = theirs(x)
        same_choice(ours.route(x, 3, norm), weights, chosen)


@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_ernie_routing_equals_ernie4_5_moe_s(tokens):
    from transformers import Ernie4_5_MoeConfig
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

    config = Ernie4_5_MoeConfig(hidden_size=32, moe_num_experts=16, moe_k=3)
    theirs = Ernie4_5_MoeTopKRouter(config)
    ours = CorrectedRouter(16, 32, "softmax", norm_min=config.moe_norm_min)
    gen = torch.Generator().manual_seed(tokens)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(16, 32, generator=gen))
        theirs.moe_statics.e_score_correction_bias.copy_(torch.randn(1, 16, generator=gen) * 0.1)
        ours.weight.copy_(theirs.weight)
        ours.e_score_correction_bias.copy_(theirs.moe_statics.e_score_correction_bias[0])
        x = torch.randn(tokens, 32, generator=gen)
        _, weights, chosen = theirs(x)
        same_choice(ours.route(x, 3, True), weights, chosen)


@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_hunyuan_routing_in_bfloat16_equals_hunyuan_v1_moe_s(tokens):
    """Hunyuan MoE's router scores bfloat16 tokens in float32, as its transformers class
    keeps `wg` (in the model's dtype the near-tied choices moved)."""
    from transformers import HunYuanMoEV1Config
    from transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe import HunYuanMoEV1Gate

    from services.worker.layers.mlp import MLP

    config = HunYuanMoEV1Config(hidden_size=32, num_experts=16, moe_topk=3, intermediate_size=8)
    theirs = HunYuanMoEV1Gate(config)
    ours = SparseMoE(32, 8, 16, 3, renormalize=True, expert=MLP, router_float32=True)  # (its weights as loaded:
    # tests/test_model_families.py checks the loader keeps them float32)
    gen = torch.Generator().manual_seed(tokens)
    with torch.no_grad():
        theirs.wg.weight.copy_(torch.randn(16, 32, generator=gen))
        ours.gate.weight.copy_(theirs.wg.weight)
        x = torch.randn(tokens, 32, generator=gen).to(torch.bfloat16)
        _, weights, chosen = theirs(x)
        same_choice(ours.route(x), weights.to(torch.bfloat16), chosen)


@pytest.mark.parametrize("method, groups, kept", [("greedy", 1, 1), ("group_limited_greedy", 4, 2),
                                                  ("group_limited_greedy", 8, 3)])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_deepseek_v2_routing_equals_deepseek_v2_s(method, groups, kept, tokens):
    """Softmax scores alone (no correction), a group ranked by its best expert, the chosen
    scores scaled and never renormalized."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    config = DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3, n_group=groups,
                              topk_group=kept, topk_method=method, routed_scaling_factor=1.5)
    theirs = DeepseekV2TopkRouter(config)
    ours = CorrectedRouter(16, 32, "softmax", groups, kept, 1.5, corrected=False, group_by_max=True)
    gen = torch.Generator().manual_seed(groups * 100 + tokens)
    with torch.no_grad():
        theirs.weight.copy_(torch.randn(16, 32, generator=gen))
        ours.weight.copy_(theirs.weight)
        x = torch.randn(tokens, 32, generator=gen)
        _, weights, chosen = theirs(x)
        same_choice(ours.route(x, 3, False), weights, chosen)
