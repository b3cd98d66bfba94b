"""Checkpoints in FP8 with block scales (DeepSeek-V3's and Qwen3-FP8's format), widened at
load (services/worker/models/checkpoints/fp8_weights.py): greedy output equals transformers' own
reading of the same FP8 folder (what cannot be read is refused by name: test_quantized_checkpoints.py)."""

import pytest
import torch

from llmbus import LLM, SamplingParams
from services.worker.models.checkpoints.fp8_weights import fp8_widened, widen_fp8
from tiny_models import build_tiny_model, fp8_checkpoint, hf_greedy, random_prompts

PROMPTS = random_prompts([1, 5, 16, 33, 64])
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize("arch", ["llama", "deepseek_v3", "qwen3_moe"])
def test_an_fp8_checkpoint_matches_transformers_reading_of_it(tmp_path, arch):
    """transformers widens the FP8 weights on a CPU too (its Fp8Dequantize); the FP8 model
    is not the source's (its greedy output differs), so a dropped scale would show."""
    source = build_tiny_model(tmp_path / "source", arch, seed=2)
    folder = fp8_checkpoint(source, tmp_path / "fp8", (16, 16))
    reference = hf_greedy(folder, PROMPTS, 24)
    assert reference != hf_greedy(source, PROMPTS, 24)
    llm = LLM(str(folder), dtype="float32")
    assert llm.runner.model_config.fp8_weight_block == (16, 16)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference


def test_partial_blocks_take_their_block_s_scale():
    """A weight whose rows and columns are not whole blocks: each value times the scale of
    the block it falls in (the last row and column of blocks partial)."""
    gen = torch.Generator().manual_seed(0)
    weight = (torch.randn(37, 50, generator=gen) * 40).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 4, generator=gen) + 0.5  # blocks of 16 x 16: 3 x 4, the last ones partial
    want = torch.empty(37, 50)
    for r in range(37):
        for c in range(50):
            want[r, c] = weight[r, c].float() * scale[r // 16, c // 16]
    assert torch.equal(widen_fp8(weight, scale, (16, 16)), want)
    # stacked experts: each its own scales
    assert torch.equal(widen_fp8(torch.stack([weight, weight]), torch.stack([scale, 2 * scale]), (16, 16)),
                       torch.stack([want, 2 * want]))
    with pytest.raises(ValueError, match=r"FP8 scales \(3, 3\) do not tile a weight of \(37, 50\)"):
        widen_fp8(weight, scale[:, :3], (16, 16))


def test_weights_and_scales_pair_whichever_comes_first_and_an_unpaired_one_is_named():
    fp8 = torch.ones(4, 4).to(torch.float8_e4m3fn)
    tensors = [("a.weight_scale_inv", torch.full((1, 1), 2.0)), ("n.weight", torch.ones(4)), ("a.weight", fp8),
               ("b.weight", fp8), ("b.weight_scale_inv", torch.full((1, 1), 3.0))]
    out = dict(fp8_widened(tensors, (4, 4)))
    assert sorted(out) == ["a.weight", "b.weight", "n.weight"]
    assert torch.equal(out["a.weight"], torch.full((4, 4), 2.0)) and torch.equal(out["b.weight"], torch.full((4, 4), 3.0))
    with pytest.raises(ValueError, match="unpaired: c.weight"):
        list(fp8_widened([("c.weight", fp8)], (4, 4)))
