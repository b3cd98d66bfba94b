"""Quantized checkpoints (AutoAWQ's GEMM layout, GPTQ's, compressed-tensors' W4A16/W8A16,
FP8 and W8A8), widened at load (services/worker/models/checkpoints/quantized_weights.py): greedy
output equals transformers on the reference's reading of the same folder; on a CPU in
bfloat16 a 4-bit one is served at 4 bits on its own levels; what cannot be read is refused
by name."""

import json

import openai
import pytest
import torch
from safetensors.torch import load_file

from deployment import llmbus_serve
from quantized_checkpoints import awq_checkpoint, ct_checkpoint, dense_reference, gptq_checkpoint, quantized_tensors
from llmbus import LLM, SamplingParams
from services.worker.layers.quantized_linear import Int8Linear, int4_grid
from services.worker.models.checkpoints.quantized_weights import quantized_widened, quantized_weight_format
from tiny_models import build_tiny_model, hf_greedy, random_prompts

PROMPTS = random_prompts([1, 5, 16, 33])
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)

FORMATS = {
    "W4A16 symmetric": lambda source, dest: ct_checkpoint(source, dest),
    "W4A16 asymmetric": lambda source, dest: ct_checkpoint(source, dest, symmetric=False),
    "W8A16 per channel": lambda source, dest: ct_checkpoint(source, dest, bits=8, group_size=None),
    "AWQ": lambda source, dest: awq_checkpoint(source, dest),
    "AWQ without zero points": lambda source, dest: awq_checkpoint(source, dest, zero_point=False),
    "FP8 dynamic per channel": lambda source, dest: ct_checkpoint(
        source, dest, bits=8, fmt="float-quantized", kind="float", strategy="channel", dynamic_activations=True),
    "FP8 block, partial blocks": lambda source, dest: ct_checkpoint(
        source, dest, bits=8, fmt="float-quantized", kind="float", strategy="block", block=(16, 24),
        dynamic_activations=True),
    "FP8 weights per tensor": lambda source, dest: ct_checkpoint(
        source, dest, bits=8, fmt="float-quantized", kind="float", strategy="tensor"),
    "W8A8 INT8 per channel": lambda source, dest: ct_checkpoint(
        source, dest, bits=8, fmt="int-quantized", strategy="channel", dynamic_activations=True),
    "INT8 weights asymmetric per group": lambda source, dest: ct_checkpoint(
        source, dest, bits=8, fmt="int-quantized", symmetric=False, group_size=16),
    "GPTQ Int4": lambda source, dest: gptq_checkpoint(ct_checkpoint(source, dest.with_name("ct")), dest),
    "GPTQ Int8": lambda source, dest: gptq_checkpoint(ct_checkpoint(source, dest.with_name("ct"), bits=8), dest),
    "GPTQ v2 asymmetric": lambda source, dest: gptq_checkpoint(
        ct_checkpoint(source, dest.with_name("ct"), symmetric=False), dest, zeros_less_one=False),
    "GPTQ desc_act": lambda source, dest: gptq_checkpoint(ct_checkpoint(source, dest.with_name("ct")), dest,
                                                          reordered=True),
}


def reference_folder(folder, dest):
    """The reference's reading: compressed-tensors' own decompression; a GPTQ folder's, of
    the pack-quantized folder it was laid out from (its function the same, reordered too)."""
    config = json.loads((folder / "config.json").read_text())
    return dense_reference(folder.with_name("ct") if config["quantization_config"]["quant_method"] == "gptq"
                           else folder, dest)


@pytest.mark.parametrize("arch, fmt", [("llama", f) for f in FORMATS] + [("qwen3_moe", "AWQ"), ("qwen3_moe", "GPTQ Int4")])
def test_a_quantized_checkpoint_matches_transformers_on_the_reference_reading_of_it(tmp_path, arch, fmt):
    """The reference: compressed-tensors' own decompression (AWQ through its AutoAWQ
    converter) run by transformers; the quantized model is not the source's (its greedy
    output differs), so a level, zero point or scale read in the wrong place would show."""
    source = build_tiny_model(tmp_path / "source", arch, seed=2)
    folder = FORMATS[fmt](source, tmp_path / "quantized")
    dense = reference_folder(folder, tmp_path / "reference")
    # Every weight as the reference widens it, to the last bit (float32: exact products),
    # but a reordered GPTQ's MLP, whose features are in another order
    fmt_read = quantized_weight_format(json.loads((folder / "config.json").read_text()))
    widened = dict(quantized_widened(load_file(str(folder / "model.safetensors")).items(), fmt_read))
    assert widened.keys() == load_file(str(dense / "model.safetensors")).keys()
    assert all(torch.equal(widened[n], t) for n, t in load_file(str(dense / "model.safetensors")).items()
               if not (fmt_read.reordered and ".mlp." in n))
    reference = hf_greedy(dense, PROMPTS, 16)
    assert reference != hf_greedy(source, PROMPTS, 16)
    llm = LLM(str(folder), dtype="float32")
    assert llm.runner.model_config.quantized_weights is not None and llm.runner.quantization is None
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference


def test_served_by_llmbus_serve_as_the_reference_computes_it(tmp_path):
    """`llmbus serve AWQ_FOLDER --dtype float32`, through the openai client: the worker
    service reads the checkpoint as LLM does."""
    folder = awq_checkpoint(build_tiny_model(tmp_path / "source", "llama", seed=2), tmp_path / "awq")
    reference = hf_greedy(dense_reference(folder, tmp_path / "reference"), PROMPTS, 16)
    proc, url = llmbus_serve([str(folder), "--served-model-name", "tiny-awq", "--dtype", "float32"],
                             tmp_path / "stderr.log")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        got = []
        for prompt in PROMPTS:
            answer = client.completions.create(model="tiny-awq", prompt=prompt, max_tokens=16, temperature=0,
                                               logprobs=0, extra_body={"ignore_eos": True,
                                                                       "return_tokens_as_token_ids": True})
            got.append([int(token.removeprefix("token_id:")) for token in answer.choices[0].logprobs.tokens])
        assert got == reference
    finally:
        proc.terminate()
        proc.wait(60)


def test_transformers_own_loading_of_a_symmetric_w4a16_folder_agrees(tmp_path):
    """Where transformers reads the folder itself (compressed-tensors installed: it
    decompresses on the first forward), its greedy output is the same as the reference's."""
    source = build_tiny_model(tmp_path / "source", "llama", seed=2)
    folder = ct_checkpoint(source, tmp_path / "quantized")
    assert hf_greedy(folder, PROMPTS, 16) == hf_greedy(dense_reference(folder, tmp_path / "reference"), PROMPTS, 16)


def test_the_awq_packer_of_the_tests_puts_each_weight_where_the_converter_reads_it(tmp_path):
    """The reference's weights within a level of the source's (half for the level's
    rounding, half for the zero point's): the order the tests pack in is AutoAWQ's (else the reference would be a shuffled model, and the parity
    above would check the reader against nonsense)."""
    source = build_tiny_model(tmp_path / "source", "llama", seed=2)
    dense = load_file(str(dense_reference(awq_checkpoint(source, tmp_path / "awq"), tmp_path / "reference")
                          / "model.safetensors"))
    originals, names = quantized_tensors(source)
    for name in names:
        spread = originals[name].float().unflatten(1, (-1, 16))
        step = (spread.amax(-1).clamp(min=0) - spread.amin(-1).clamp(max=0)) / 15
        error = (dense[name] - originals[name].float()).unflatten(1, (-1, 16)).abs()
        assert bool((error <= step[..., None] * 1.001 + 1e-6).all()), name


def test_a_4_bit_checkpoint_is_served_at_4_bits_on_its_own_levels_in_bfloat16_on_a_cpu(tmp_path, caplog):
    """As vLLM serves an AWQ checkpoint at its 4 bits: int4 without asking, and int4_grid
    finds every widened weight's levels again (each group of 32 inputs on one step of the
    checkpoint's float16 scales; the offsets kept to float16, within 1/100 of a level)."""
    source = build_tiny_model(tmp_path / "source", "llama", seed=2)
    folder = awq_checkpoint(source, tmp_path / "awq", group_size=64)
    assert LLM(str(folder), dtype="bfloat16").runner.quantization == "int4"
    assert LLM(str(folder), dtype="bfloat16", quantization="int8").runner.quantization == "int8"
    fmt = quantized_weight_format(json.loads((folder / "config.json").read_text()))
    tensors = load_file(str(folder / "model.safetensors"))
    widened = dict(quantized_widened(tensors.items(), fmt))
    checked = 0
    for module in [n.removesuffix(".qweight") for n in tensors if n.endswith(".qweight")]:
        weight, scales = widened[f"{module}.weight"], tensors[f"{module}.scales"].float()  # [out, in], [groups, out]
        levels, step, low = int4_grid(weight)
        out_features, in_features = weight.shape
        rebuilt = (levels.view(out_features, -1, 32) * step[..., None] + low[..., None]).view(weight.shape)
        assert torch.equal(rebuilt, weight), module
        # The step: the checkpoint's scale (or a whole multiple where a group of 32 skips levels)
        group_scale = scales.T.repeat_interleave(2, 1)  # [out, in / 32]: 64-input groups, two of 32 each
        multiple = step / group_scale
        assert torch.equal(multiple, multiple.round()) and torch.equal(step.half().float(), step), module
        assert bool(((low.half().float() - low).abs() <= group_scale / 100).all()), module
        checked += 1
    assert checked == 14  # 7 projections in each of 2 layers
    with caplog.at_level("WARNING", logger="services.worker.models.quantization"):
        assert LLM(str(folder), dtype="float32").runner.quantization is None  # (float32: widened, and said so)
    assert "quantized checkpoint widened to float32" in caplog.text


def test_a_per_channel_int8_checkpoint_is_served_at_8_bits_on_its_own_levels_in_bfloat16_on_a_cpu(tmp_path):
    """As vLLM's CPU backend serves W8A8 INT8: int8 without asking, its layers' grid
    (int8_grid) finding the checkpoint's levels and scales again, in channels whose largest
    weight lies on level -128 too (min/max quantization spans -128..127). Int8 checkpoints
    of other shapes (groups, zero points) and float8 ones run widened."""
    source = build_tiny_model(tmp_path / "source", "llama", seed=2)
    folder = ct_checkpoint(source, tmp_path / "w8a8", bits=8, fmt="int-quantized", strategy="channel",
                           dynamic_activations=True)
    assert LLM(str(folder), dtype="bfloat16").runner.quantization == "int8"
    assert LLM(str(folder), dtype="float32").runner.quantization is None
    fmt = quantized_weight_format(json.loads((folder / "config.json").read_text()))
    tensors = load_file(str(folder / "model.safetensors"))
    widened = dict(quantized_widened(tensors.items(), fmt))
    checked = 0
    for module in [n.removesuffix(".weight_scale") for n in tensors if n.endswith(".weight_scale")]:
        layer = Int8Linear(widened[f"{module}.weight"], kernel="torch")
        assert torch.equal(layer.weight_int8, tensors[f"{module}.weight"]), module
        assert torch.equal(layer.scales, tensors[f"{module}.weight_scale"].flatten().to(torch.bfloat16)), module
        checked += 1
    assert checked == 14  # 7 projections in each of 2 layers
    for name, other in {"W8A16 per group": dict(bits=8, group_size=16),
                        "int8 asymmetric per channel": dict(bits=8, fmt="int-quantized", strategy="channel",
                                                            symmetric=False),
                        "FP8 per channel": dict(bits=8, fmt="float-quantized", kind="float", strategy="channel")}.items():
        assert LLM(str(ct_checkpoint(source, tmp_path / name, **other)), dtype="bfloat16").runner.quantization is None


def test_gptq_s_reordered_groups_run_widened_in_bfloat16(tmp_path):
    """desc_act: a group is no run of inputs, so no run of 32 keeps one grid: int4 would
    quantize again what the checkpoint quantized, so those run widened; in order, int4."""
    ct = ct_checkpoint(build_tiny_model(tmp_path / "source", "llama", seed=2), tmp_path / "ct", group_size=32)
    assert LLM(str(gptq_checkpoint(ct, tmp_path / "in_order")), dtype="bfloat16").runner.quantization == "int4"
    assert LLM(str(gptq_checkpoint(ct, tmp_path / "reordered", reordered=True)),
               dtype="bfloat16").runner.quantization is None


@pytest.mark.parametrize("quantization_config, why", [
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "unsupported AWQ version 'gemv'"),
    ({"quant_method": "awq", "bits": 8}, "unsupported AWQ bits 8"),
    ({"quant_method": "compressed-tensors", "config_groups": {}}, "without config_groups"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}}},
     "unsupported compressed-tensors format 'nvfp4-pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
              "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False}}}},
     "unsupported compressed-tensors static input_activations"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor"}}}},
     "unsupported compressed-tensors float-quantized weights float 4 bits"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "int", "strategy": "tensor"}}}},
     "unsupported compressed-tensors pack-quantized weight strategy 'tensor'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "actorder": "group"}}}},
     "unsupported compressed-tensors actorder 'group'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
        "a": {"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}},
        "b": {"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
     "mixing weight schemes"),
    ({"quant_method": "gptq", "bits": 3}, "unsupported GPTQ bits 3"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "unsupported GPTQ checkpoint_format 'marlin'"),
    ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*down_proj": {}}}, "unsupported GPTQ dynamic"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "unsupported quantization_config quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "unsupported FP8 checkpoint without block scales"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
     "unsupported FP8 activation_scheme 'static'"),
])
def test_a_quantized_checkpoint_it_cannot_read_is_refused_by_name(tmp_path, quantization_config, why):
    folder = build_tiny_model(tmp_path / "m", "llama", seed=2)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    with pytest.raises(ValueError, match=why):
        LLM(str(folder))


def test_a_layer_missing_a_part_is_named(tmp_path):
    source = build_tiny_model(tmp_path / "source", "llama", seed=2)
    folder = awq_checkpoint(source, tmp_path / "awq")
    fmt = quantized_weight_format(json.loads((folder / "config.json").read_text()))
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.scales"]
    with pytest.raises(ValueError, match=r"incomplete: model.layers.1.mlp.up_proj \(has qweight, qzeros\)"):
        dict(quantized_widened(tensors.items(), fmt))
