"""Decode steps from persistent buffers (decode_graphs.py) in "replay" mode: what a CUDA
graph computes — buffers filled in place, batches padded to a captured size, pads in the
pad block, outputs read from the output buffer — run eagerly, so CI checks the discipline
a GPU's graphs rely on. Greedy output must still equal transformers', under every
scheduling mode, and a padded row must never touch a real KV block."""

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

import kernels.cpu as cpu_kernels
from llmbus import LLM, SamplingParams
from services.worker.decode_graphs import capture_sizes
from tiny_models import build_tiny_model, hf_greedy, random_prompts

needs_cpu_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
# 7 requests: decode batches of 7, then fewer as they finish, padded to 8, 4, 2 or 1.
PROMPTS = random_prompts([1, 5, 16, 17, 33, 64, 100])
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "disable_by_batch_size": None}

CASES = {
    "batch": {},
    "sync_scheduling": {"async_scheduling": False},
    "chunked_prefill": {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8},
    "preemption": {"num_kv_blocks": 12, "block_size": 16, "enable_prefix_caching": False},
    "block_size_32": {"block_size": 32, "max_num_batched_tokens": 40},
    "small_capture_size": {"max_cudagraph_capture_size": 4},  # batches of 5-7 run eager
    "speculative": {"speculative_config": SPEC},
}


def replaying(folder, **kwargs) -> LLM:
    llm = LLM(str(folder), **kwargs)
    llm.runner.set_decode_graphs("replay")
    return llm


def generate_ids(llm: LLM, prompts, params=GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    return hf_greedy(tiny_llama, PROMPTS, MAX_NEW)


def test_capture_sizes_are_vllms():
    assert capture_sizes(1) == [1]
    assert capture_sizes(4) == [1, 2, 4]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(256)[-1] == 256


@pytest.mark.parametrize("case", CASES)
def test_replayed_decode_steps_give_transformers_tokens(tiny_llama, reference, case):
    llm = replaying(tiny_llama, **CASES[case])
    assert generate_ids(llm, PROMPTS) == reference
    assert generate_ids(llm, PROMPTS[:3]) == reference[:3]  # decode batches of 3, padded to 4
    assert llm.runner.decode_graphs.steps > 0  # decode steps did run from the buffers
    if case == "preemption":
        assert llm.stats().num_preemptions > 0


def test_speculative_verify_steps_replay_with_drafts_accepted(tiny_llama):
    texts = ["the cat sat on the mat, the cat sat on the mat, the cat", "1 2 3 4 5 1 2 3 4 5 1 2 3", "abc abc abc"]
    llm = replaying(tiny_llama, speculative_config=SPEC)
    prompts = [llm.tokenizer.encode(t) for t in texts]
    got = generate_ids(llm, prompts, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert got == hf_greedy(tiny_llama, prompts, 40)
    assert llm.stats().spec_decode_num_accepted_tokens > 0
    assert llm.runner.decode_graphs.steps > 0


def test_seeded_sampling_is_the_same_replayed_or_eager(tiny_llama):
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=MAX_NEW, ignore_eos=True)
              for i in range(len(PROMPTS))]
    eager = generate_ids(LLM(str(tiny_llama)), PROMPTS, params)
    replayed = generate_ids(replaying(tiny_llama), PROMPTS, params)
    assert replayed == eager
    assert len({tuple(t) for t in eager}) == len(PROMPTS)  # they did sample, differently per seed


def test_padded_rows_write_only_the_pad_block(tiny_llama):
    """The same workload eager and replayed leaves the same keys and values in every real
    block (to float32 roundings: attention's CPU kernel sums a batch of 4 in another order
    than one of 3) and the same slots untouched; only the pad block, which the scheduler
    never hands out, differs: the pads wrote there."""
    kwargs = {"num_kv_blocks": 64, "enable_prefix_caching": False}
    eager, replayed = LLM(str(tiny_llama), **kwargs), replaying(tiny_llama, **kwargs)
    for llm in (eager, replayed):  # token 0 (the pads') embeds to zeros here: K/V too; make it visible
        llm.runner.model.model.embed_tokens.weight[0] = 0.5
    prompts = PROMPTS[:3]  # decode batches of 3: padded to 4
    assert generate_ids(eager, prompts) == generate_ids(replayed, prompts)
    pad = replayed.runner.pad_block
    assert pad == 64
    for a, b in zip(eager.runner.kv_caches, replayed.runner.kv_caches, strict=True):
        assert a.shape[1] == b.shape[1] == 65  # the scheduler's 64 and the pad block
        assert torch.equal(a[:, :pad] == 0, b[:, :pad] == 0)  # the same slots written
        torch.testing.assert_close(a[:, :pad], b[:, :pad], rtol=1e-5, atol=1e-5)
        assert not a[:, pad].any() and b[:, pad].any()


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_replay_on_the_fused_decode_layer(tmp_path, dtype):
    """Head dim 64: decode steps take the CPU kernels' one-call-a-layer path, from the buffers."""
    folder = build_tiny_model(tmp_path / "hd64", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=64, intermediate_size=256, initializer_range=0.08)
    eager = LLM(str(folder), dtype=dtype)
    assert eager.runner.model.fused_decode is not None
    replayed = replaying(folder, dtype=dtype)
    got = generate_ids(replayed, PROMPTS)
    assert got == generate_ids(eager, PROMPTS)
    if dtype == "float32":
        assert got == hf_greedy(folder, PROMPTS, MAX_NEW)
    assert replayed.runner.decode_graphs.steps > 0


def test_capture_needs_cuda(tiny_llama):
    llm = LLM(str(tiny_llama))
    assert llm.runner.decode_graphs is None  # eager on CPU by default
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        llm.runner.set_decode_graphs("capture")


def test_replay_on_triton_attention_with_the_graphs_fixed_split_count(tiny_llama):
    """Under Triton's interpreter: the kernels a GPU graph records, with what capture fixes
    (one query a row, the split-KV count for max_model_len keys: 8 splits here, most of
    them empty for these short rows)."""
    from services.worker.attention.triton_backend import choose_num_splits

    prompts = random_prompts([1, 5, 17], seed=3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = replaying(tiny_llama, attention_backend="triton", max_model_len=2048)
    assert choose_num_splits(4, llm.runner.model_config.num_key_value_heads, 1, 2048) == 8
    assert generate_ids(llm, prompts, params) == hf_greedy(tiny_llama, prompts, 6)
    assert llm.runner.decode_graphs.steps > 0


# What reads a device tensor on the host (or copies host data to the device), which a CUDA
# graph's capture refuses: the scalar conversions, host copies, and ops whose output size
# depends on the data.
HOST_READS = frozenset({"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__",
                        "nonzero", "argwhere", "unique", "unique_consecutive", "masked_select", "bincount",
                        "tensor", "as_tensor", "from_numpy"})


class HostReads(TorchFunctionMode):
    """Records each torch call of HOST_READS (and indexing by a boolean mask, and
    repeat_interleave without output_size) made outside Triton's interpreter, which reads
    tensors on the host to emulate a kernel a GPU runs on the device."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        reads = name in HOST_READS or (name == "repeat_interleave" and "output_size" not in kwargs)
        if name in ("__getitem__", "__setitem__"):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            reads = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index)
        if reads and not self._in_triton(sys._getframe(1)):
            caller = sys._getframe(1)
            self.found.append(f"{name} at {caller.f_code.co_filename}:{caller.f_lineno}")
        return func(*args, **kwargs)

    @staticmethod
    def _in_triton(frame) -> bool:
        while frame is not None:
            if "/triton/" in frame.f_code.co_filename:
                return True
            frame = frame.f_back
        return False


@pytest.mark.parametrize("arch", ["llama", "mixtral"])
def test_the_graphed_forward_reads_no_device_data_on_the_host(tmp_path, arch):
    """What a GPU records (Triton attention and element-wise kernels, the fused MoE
    kernel's routing) makes no call that would wait for the device inside the graph: on a
    GPU one such call makes capture fail and every decode step run eager."""
    folder = build_tiny_model(tmp_path / arch, arch)
    llm = replaying(folder, attention_backend="triton", max_model_len=256)
    graphs, forward, modes = llm.runner.decode_graphs, llm.runner.decode_graphs._forward, []

    def watched(size: int) -> torch.Tensor:
        modes.append(HostReads())
        with modes[-1]:
            return forward(size)

    graphs._forward = watched
    prompts, params = random_prompts([3, 7, 12]), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert generate_ids(llm, prompts, params) == hf_greedy(folder, prompts, 4)
    assert len(modes) == graphs.steps == 3
    assert [found for mode in modes for found in mode.found] == []


def test_host_reads_are_seen():
    """The watch itself: each kind of host read in a forward is recorded."""
    x = torch.arange(6)
    with HostReads() as mode:
        x.sum().item(), x.tolist(), bool(x[0]), x[x > 2], x.nonzero(), x.repeat_interleave(2)
        torch.tensor([1, 2]), x.repeat_interleave(2, output_size=12), x[1:3], x * 2
    assert [f.split(" at ")[0] for f in mode.found] == [
        "item", "tolist", "__bool__", "__getitem__", "nonzero", "repeat_interleave", "tensor"]


def test_dummy_weights_load_a_config_with_no_checkpoint(tiny_llama, tmp_path):
    import shutil

    folder = tmp_path / "no-weights"
    shutil.copytree(tiny_llama, folder, ignore=shutil.ignore_patterns("*.safetensors*"))
    with pytest.raises(ValueError, match="has no safetensors"):
        LLM(str(folder))
    with pytest.raises(ValueError, match="unknown load_format"):
        LLM(str(folder), load_format="npz")
    first, second = LLM(str(folder), load_format="dummy"), LLM(str(folder), load_format="dummy")
    assert generate_ids(first, PROMPTS[:2]) == generate_ids(second, PROMPTS[:2])  # seeded: the same weights
    norm = first.runner.model.model.layers[0].input_layernorm.weight
    assert torch.equal(norm, torch.ones_like(norm))
    weight = first.runner.model.model.embed_tokens.weight
    assert abs(float(weight.std()) - 0.02) < 0.002
