"""Which packed product serves each weight shape (services/worker/layers/kernel_choice.py):
the choice from timings (injected here: the machine running the suite decides nothing),
remembered per CPU, forced by LLMBUS_CPU_KERNELS (a choice the CPU lacks is an error), and
a layer split between llmbus's product and oneDNN's at its row count — the one-call decode
layer stepping aside there — still gives transformers' greedy output in float32."""

from __future__ import annotations

import json

import pytest
import torch

import kernels.cpu as cpu_kernels
from llmbus import LLM, SamplingParams
from services.worker.layers import kernel_choice
from services.worker.layers.kernel_choice import KernelChoices, decide
from services.worker.layers.packed_linear import PackedLinear
from tiny_models import build_tiny_model, hf_greedy, random_prompts

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason=f"CPU kernels: {cpu_kernels.unavailable_reason()}")


def test_onednn_takes_the_row_counts_from_which_it_is_clearly_faster():
    ours_everywhere = {1: (1.0, 1.5), 8: (1.0, 1.2), 128: (1.0, 1.05), 512: (1.0, 0.95)}  # (0.95: inside the margin)
    assert decide(ours_everywhere) is None
    amx_like = {1: (1.0, 1.4), 8: (1.0, 1.0), 32: (1.0, 0.6), 128: (1.0, 0.4), 512: (1.0, 0.4)}
    assert decide(amx_like) == 32
    assert decide({1: (1.0, 0.5), 8: (1.0, 0.5)}) == 1
    # faster at 128 but not at the largest count measured: no switch (it would switch back);
    # faster at the largest count alone: a moment's noise as likely as not
    assert decide({1: (1.0, 2.0), 128: (1.0, 0.5), 512: (1.0, 1.0)}) is None
    assert decide({1: (1.0, 2.0), 128: (1.0, 1.0), 512: (1.0, 0.5)}) is None
    assert decide({1: (1.0, 0.5)}) == 1  # (a shape so large one count was timed)


def test_a_shape_is_measured_once_a_machine_and_remembered(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_choice.cpu_kernels, "available", lambda: True)
    calls = []

    def timer(weight):
        calls.append(tuple(weight.shape))
        return {1: (1.0, 2.0), 64: (1.0, 0.5), 512: (1.0, 0.4)}

    path = tmp_path / "choices.json"
    big, other, tiny = torch.zeros(1024, 512), torch.zeros(512, 1024), torch.zeros(64, 128)
    choices = KernelChoices(timer, "auto", path)
    assert [choices.rows_from(w) for w in (big, big, other, tiny)] == [64, 64, 64, None]
    assert calls == [(1024, 512), (512, 1024)]  # (each shape once; the tiny one never: its call times the call)
    choices.finish()
    stored = json.loads(path.read_text())
    assert len(stored) == 2 and all("1024x512" in k or "512x1024" in k for k in stored)
    again = KernelChoices(timer, "auto", path)
    assert again.rows_from(big) == 64 and len(calls) == 2
    # another thread count is another measurement (the key holds it)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert KernelChoices(timer, "auto", path).rows_from(big) == 64 and len(calls) == 3
    # forced: llmbus's everywhere, or oneDNN's everywhere
    assert KernelChoices(timer, "avx512", path).rows_from(big) is None
    assert KernelChoices(timer, "amx", path).rows_from(big) == 1


def test_a_forced_choice_the_cpu_lacks_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(kernel_choice, "cpu_flags", lambda: {"avx2", "avx512_bf16"})
    monkeypatch.setenv("LLMBUS_CPU_KERNELS", "amx")
    with pytest.raises(ValueError, match="LLMBUS_CPU_KERNELS=amx: this CPU has no AMX"):
        kernel_choice.mode()
    monkeypatch.setenv("LLMBUS_CPU_KERNELS", "fast")
    with pytest.raises(ValueError, match="LLMBUS_CPU_KERNELS='fast': one of auto, 1, avx512, amx, 0"):
        kernel_choice.mode()
    monkeypatch.setattr(kernel_choice, "cpu_flags", lambda: {"amx_bf16", "amx_tile"})
    monkeypatch.setenv("LLMBUS_CPU_KERNELS", "amx")
    assert kernel_choice.mode() == "amx"


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_split_layer_runs_each_side_s_product(dtype):
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=gen).to(dtype), torch.randn(96, generator=gen).to(dtype)
    split = PackedLinear(weight, bias, "llmbus", rows_from=8)
    ours, theirs = PackedLinear(weight, bias, "llmbus"), PackedLinear(weight, bias, "onednn")
    few, many = torch.randn(7, 64, generator=gen).to(dtype), torch.randn(8, 64, generator=gen).to(dtype)
    assert torch.equal(split(few), ours(few)) and torch.equal(split(many), theirs(many))
    assert PackedLinear(weight, bias, "llmbus", rows_from=1).kernel == "onednn"


@needs_kernels
def test_from_the_split_the_one_call_decode_layer_steps_aside(tmp_path, monkeypatch):
    """Every product oneDNN's from 4 rows: steps of 4 decodes or more run the module path,
    fewer the one-call layer; float32 output is transformers' either way."""
    from services.worker.models.fused_decode import FusedDecode

    monkeypatch.setattr(KernelChoices, "rows_from", lambda self, weight: 4)
    rows = []
    real = FusedDecode.forward

    def forward(self, input_ids, *args, **kwargs):
        rows.append(input_ids.numel())
        return real(self, input_ids, *args, **kwargs)

    monkeypatch.setattr(FusedDecode, "forward", forward)
    folder = build_tiny_model(tmp_path / "m", "llama", hidden_size=128, num_attention_heads=2,
                              num_key_value_heads=1)  # (heads of 64: the one-call layer's)
    llm = LLM(str(folder), dtype="float32", max_model_len=256)
    assert llm.runner.model.fused_decode.max_rows == 4
    prompts = random_prompts([5, 17, 9, 30, 12, 3], seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for batch in (prompts[:2], prompts):
        got = [o.outputs[0].token_ids for o in llm.generate(batch, greedy, use_tqdm=False)]
        assert got == hf_greedy(folder, batch, 12)
    assert rows and max(rows) < 4
