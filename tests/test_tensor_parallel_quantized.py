"""--tensor-parallel-size N with quantized weights: checkpoints in AWQ's and FP8's formats
(widened as read, then cut) give transformers' reading of them token for token on two
ranks; `--quantization int8|int4` puts every rank on one rank's grid, cut — int4's groups of
32 inputs whole on a rank, int8's channel scales those of the whole channel, taken across
the ranks (a row-parallel product's rank holds part of each channel)."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from llmbus import LLM, SamplingParams
from quantized_checkpoints import awq_checkpoint, dense_reference
from services.worker.layers.quantized_linear import int8_grid
from services.worker.parallel.group import TensorParallelGroup
from tiny_models import build_tiny_model, fp8_checkpoint, hf_greedy, random_prompts

pytestmark = pytest.mark.timeout(600)

PROMPTS = random_prompts([3, 17, 40, 65], vocab_size=380, seed=7)
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("source"), "llama", seed=2)


@pytest.mark.parametrize("fmt", ["AWQ", "FP8"])
def test_two_ranks_read_a_quantized_checkpoint_as_transformers_does(source, tmp_path, fmt):
    """In float32 the checkpoint runs widened: the oracle is transformers' reading of it,
    which is not the source model's (a scale cut in the wrong place would show)."""
    if fmt == "AWQ":
        folder = awq_checkpoint(source, tmp_path / "awq")
        reference = hf_greedy(dense_reference(folder, tmp_path / "reference"), PROMPTS, 16)
    else:
        folder = fp8_checkpoint(source, tmp_path / "fp8", (16, 16))
        reference = hf_greedy(folder, PROMPTS, 16)
    assert reference != hf_greedy(source, PROMPTS, 16)
    llm = LLM(str(folder), tensor_parallel_size=2, dtype="float32", max_model_len=256, num_kv_blocks=64)
    try:
        assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    finally:
        llm.executor.close()


def _prompt_logprobs(folder, size: int, quantization: str | None) -> list[float]:
    llm = LLM(str(folder), tensor_parallel_size=size, dtype="bfloat16", quantization=quantization,
              max_model_len=256, num_kv_blocks=64)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in random_prompts([30, 47, 65], vocab_size=380, seed=3)],
                               SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        if size > 1:
            llm.executor.close()
    return [next(iter(entry.values())).logprob for o in outputs for entry in o.prompt_logprobs[1:]]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_two_ranks_quantize_as_one_rank_does(source, quantization):
    """Prompt logprobs on two ranks within bfloat16's rounding of one rank's (the partial
    sums are rounded apart): measured 0.03-0.06 apart, where int4 itself moves them 1.3 from
    bfloat16's, so a group cut across ranks would show."""
    one, two = (_prompt_logprobs(source, size, quantization) for size in (1, 2))
    plain = _prompt_logprobs(source, 1, None)
    assert max(abs(a - b) for a, b in zip(one, two)) < 0.1
    assert max(abs(a - b) for a, b in zip(one, plain)) > 0.1  # (the quantization is not a no-op)


def _grid_of_slice(rank: int, port: int, weight: torch.Tensor, results) -> None:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    group = TensorParallelGroup(rank, 2, torch.device("cpu"), store)
    try:
        results[rank] = int8_grid(weight.chunk(2, dim=1)[rank].contiguous(), group)
    finally:
        group.close()


def test_a_row_parallel_slice_takes_its_whole_channel_s_int8_scale():
    """Two gloo ranks, each half of every channel's inputs: the levels put together and the
    scales are one rank's, for a channel whose largest weight lies on either rank, and for a
    W8A8 checkpoint's channel whose largest weight sits on level -128 (kept exactly)."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 64, generator=gen)
    weight[0, 3] = 9.0   # (the largest on rank 0's half)
    weight[1, 40] = -9.0  # (on rank 1's)
    weight[2] = torch.randint(-127, 128, (64,), generator=gen).float() / 128
    weight[2, 50] = -1.0  # (level -128: a 128th of the largest is the step)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    results = mp.Manager().dict()
    procs = [mp.get_context("spawn").Process(target=_grid_of_slice, args=(rank, port, weight, results))
             for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    levels, scales = int8_grid(weight)
    assert torch.equal(torch.cat([results[0][0], results[1][0]], dim=1), levels)
    assert torch.equal(results[0][1], scales) and torch.equal(results[1][1], scales)
    assert scales[2].item() == 1 / 128
    # Each half alone would have taken its own scales: what the group changes
    assert not torch.equal(int8_grid(weight.chunk(2, dim=1)[0])[1], scales)
