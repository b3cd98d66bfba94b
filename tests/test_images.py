"""Images in (offline): a tiny random Gemma 3 (SigLIP tower, projector, its language model)
gives transformers' greedy tokens for prompts with 1-3 images of different sizes, with the
same processor, however the scheduler slices the work; an image is encoded once, its hash
keys the prefix cache, and its placeholders attend to each other both ways."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from llmbus import LLM, SamplingParams
from services.scheduler.core.request import Request
from shared.messages import EngineCoreRequest, FinishReason, ImageFeature
from shared.sampling_params import SamplingParams as Params
from tiny_models import build_tiny_model

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
PREFIX = "The quick brown fox jumps over the lazy dog. Paged attention keeps the KV cache in fixed-size blocks. "


def image(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


IMAGES = [image(0, 40, 30), image(1, 64, 64), image(2, 17, 90)]
PROMPTS = [
    {"prompt": "Describe <start_of_image> now", "multi_modal_data": {"image": IMAGES[0]}},
    {"prompt": PREFIX + "<start_of_image> and <start_of_image> differ", "multi_modal_data": {"image": IMAGES[1:]}},
    {"prompt": "<start_of_image><start_of_image> then <start_of_image>", "multi_modal_data": {"image": IMAGES}},
    {"prompt": PREFIX + "no image here"},
]


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("gemma3_images"), "gemma3_multimodal", seed=3)


def hf_generate(folder, prompts, device: str = "cpu", **processing) -> list[list[int]]:
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder, backend="pil")
    model = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).to(device)
    out = []
    for prompt in prompts:
        images = prompt.get("multi_modal_data", {}).get("image")
        inputs = processor(text=prompt["prompt"], images=images, return_tensors="pt", **processing).to(device)
        ids = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)  # (as ignore_eos)
        out.append(ids[0, inputs["input_ids"].shape[1]:].tolist())
    return out


@pytest.fixture(scope="module")
def reference(gemma3):
    return hf_generate(gemma3, PROMPTS)


def generate_ids(llm: LLM, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 12, "long_prefill_token_threshold": 5},
                                    {"num_kv_blocks": 10, "block_size": 16}, {"async_scheduling": True}],
                         ids=["plain", "chunked", "preempted", "async"])
def test_images_give_transformers_tokens(gemma3, reference, engine):
    check_engine(gemma3, PROMPTS, reference, engine)


def check_engine(folder, prompts, reference, engine: dict) -> None:
    """The engine configured so gives transformers' tokens (and preempted, where asked to)."""
    llm = LLM(str(folder), dtype="float32", **engine)
    assert generate_ids(llm, prompts) == reference
    if "num_kv_blocks" in engine:
        assert llm.stats().num_preemptions > 0


def test_the_image_counts_and_so_does_its_mask(gemma3, reference, monkeypatch):
    """Another image, other tokens; placeholders masked causally (as a text model's would
    be), other tokens too: the test above can fail on either."""
    llm = LLM(str(gemma3), dtype="float32")
    other = dict(PROMPTS[0], multi_modal_data={"image": image(9, 40, 30)})
    assert generate_ids(llm, [other]) != reference[:1]
    monkeypatch.setattr(llm.runner.images, "bidirectional", False)
    assert generate_ids(llm, PROMPTS[:3]) != reference[:3]


def test_an_image_is_encoded_once_and_keys_the_prefix_cache(gemma3, reference):
    llm = LLM(str(gemma3), dtype="float32", block_size=16)
    first = llm.generate(PROMPTS[1], GREEDY)[0]
    encoded = llm.runner.images.num_encoded
    again = llm.generate(PROMPTS[1], GREEDY)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == reference[1]
    assert llm.runner.images.num_encoded == encoded == 2  # (the second time from the encoder cache)
    assert again.num_cached_tokens >= 32
    # The same text, another second image: the hit stops at the block that image starts in.
    swapped = dict(PROMPTS[1], multi_modal_data={"image": [IMAGES[1], image(7, 64, 64)]})
    out = llm.generate(swapped, GREEDY)[0]
    second_image = [i for i, t in enumerate(out.prompt_token_ids) if t == 386][4]
    assert out.num_cached_tokens == second_image // 16 * 16 < again.num_cached_tokens
    assert out.outputs[0].token_ids == hf_generate(gemma3, [swapped])[0]


def test_an_image_never_spans_two_steps():
    request = Request("r", list(range(40)), Params(), None, 10,
                      mm_features=[ImageFeature("a", 10, 8, [1], b""), ImageFeature("b", 30, 4, [1], b"")])
    assert request.whole_images(0, 12, 12) == 10  # cut before the image it cannot take whole
    assert request.whole_images(10, 5, 12) == 8  # starting at one: all of it, past the threshold
    assert request.whole_images(12, 3, 12) == 6  # starting inside one (a prefix hit): to its end
    assert request.whole_images(10, 5, 7) == 0  # not this step: no room for all of it
    assert request.whole_images(18, 12, 12) == 12  # ends at an image's start: untouched


def test_bad_image_inputs_are_refused_by_name(gemma3, tiny_llama):
    llm = LLM(str(gemma3), dtype="float32", max_num_batched_tokens=3, enable_chunked_prefill=True)
    with pytest.raises(ValueError, match="more than a step computes"):
        llm.generate(PROMPTS[0], GREEDY)
    llm = LLM(str(gemma3), dtype="float32")
    with pytest.raises(ValueError, match="marks 1 image"):
        llm.generate({"prompt": "one <start_of_image>", "multi_modal_data": {"image": IMAGES[:2]}}, GREEDY)
    with pytest.raises(TypeError, match="must be a PIL image"):
        llm.generate({"prompt": "<start_of_image>", "multi_modal_data": {"image": "cat.png"}}, GREEDY)
    with pytest.raises(ValueError, match="modality 'video'"):
        llm.generate({"prompt": "a", "multi_modal_data": {"video": IMAGES[0]}}, GREEDY)
    with pytest.raises(ValueError, match="not 'prompt_token_ids'"):
        llm.generate({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": IMAGES[0]}}, GREEDY)
    text_model = LLM(str(tiny_llama))
    with pytest.raises(ValueError, match="LlamaForCausalLM takes no images"):
        text_model.generate({"prompt": "a", "multi_modal_data": {"image": IMAGES[0]}}, GREEDY)
    with pytest.raises(ValueError, match="LlamaForCausalLM takes no images"):
        text_model.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": IMAGES[0]}]}], GREEDY)
    with pytest.raises(ValueError, match=r"content\[0\].image_url: image 0 cannot be read"):
        bad = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        llm.chat([{"role": "user", "content": [bad]}], GREEDY)


def test_the_language_model_alone_loads_no_image_encoder(gemma3, reference):
    """vLLM's limit_mm_per_prompt {"image": 0}: no image encoder (its weights never read),
    text prompts as with one, image prompts refused by name, and a worker so built that is
    sent one anyway (another deployment's gateway) fails that request alone; a limit of 1
    holds a prompt to one image."""
    llm = LLM(str(gemma3), dtype="float32", limit_mm_per_prompt={"image": 0})
    full = LLM(str(gemma3), dtype="float32", limit_mm_per_prompt={"image": 1})
    assert llm.runner.images is None and full.runner.images is not None
    text = [i for i, p in enumerate(PROMPTS) if "multi_modal_data" not in p]
    assert generate_ids(llm, [PROMPTS[i] for i in text]) == [reference[i] for i in text]
    with pytest.raises(ValueError, match="1 image.s., more than limit_mm_per_prompt's 0"):
        llm.generate(PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="more than limit_mm_per_prompt's 0"):
        llm.chat([{"role": "user", "content": [{"type": "image_pil", "image_pil": IMAGES[0]}]}], GREEDY)
    assert generate_ids(full, PROMPTS[:1]) == reference[:1]
    with pytest.raises(ValueError, match="2 image.s., more than limit_mm_per_prompt's 1"):
        full.generate(PROMPTS[1], GREEDY)
    token_ids, features = full._image_prompts().encode(PROMPTS[0]["prompt"], [IMAGES[0]])
    llm.scheduler.add_request(EngineCoreRequest("img", token_ids, Params(max_tokens=2), mm_features=features))
    landed = llm.run_in_engine(llm.engine.step())
    [out] = [o for outs in landed.outputs.values() for o in outs.outputs]
    assert out.finish_reason == FinishReason.ERROR and "no image encoder" in out.error
    assert generate_ids(llm, [PROMPTS[text[0]]]) == [reference[text[0]]]  # (it serves on)


def test_chat_with_image_parts_gives_transformers_tokens(gemma3):
    """LLM.chat as vLLM's: an image_url part (a data URL) and an image_pil part, rendered
    by the chat template as the model marks an image."""
    import base64
    import io

    buffer = io.BytesIO()
    IMAGES[1].save(buffer, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    llm = LLM(str(gemma3), dtype="float32")
    parts = [{"type": "text", "text": "Look"}, {"type": "image_pil", "image_pil": IMAGES[0]},
             {"type": "image_url", "image_url": {"url": url}}]
    out = llm.chat([{"role": "user", "content": parts}], GREEDY)[0]
    marked = "Look\n<start_of_image>\n<start_of_image>"  # (this template takes a string: parts joined)
    text = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": marked}], tokenize=False,
                                                   add_generation_prompt=True)
    assert out.prompt == text
    assert out.outputs[0].token_ids == hf_generate(gemma3, [{"prompt": text, "multi_modal_data": {"image": [
        IMAGES[0], Image.open(io.BytesIO(buffer.getvalue()))]}}], add_special_tokens=False)[0]


# Gemma 3's way: the template walks a message's parts and marks an image where its part is
PARTS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                  "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for item in m['content'] %}"
                  "{% if item['type'] == 'image' %}<start_of_image>"
                  "{% elif item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_walks_the_parts_gets_them(gemma3):
    llm = LLM(str(gemma3), dtype="float32")
    parts = [{"type": "text", "text": "Look"}, {"type": "image_pil", "image_pil": IMAGES[0]},
             {"type": "text", "text": "here"}]
    out = llm.chat([{"role": "user", "content": parts}], GREEDY, chat_template=PARTS_TEMPLATE)[0]
    assert out.prompt == "<|im_start|>user\nLook<start_of_image>here<|im_end|>\n<|im_start|>assistant\n"
    assert out.outputs[0].token_ids == hf_generate(gemma3, [{"prompt": out.prompt, "multi_modal_data": {
        "image": IMAGES[:1]}}], add_special_tokens=False)[0]
    # vLLM's "string" content format: the parts one string all the same, the image its marker
    joined = llm.chat([{"role": "user", "content": parts}], GREEDY, chat_template=PARTS_TEMPLATE,
                      chat_template_content_format="string")[0]
    assert joined.prompt == "<|im_start|>user\nLook\n<start_of_image>\nhere<|im_end|>\n<|im_start|>assistant\n"
    assert joined.outputs[0].token_ids == hf_generate(gemma3, [{"prompt": joined.prompt, "multi_modal_data": {
        "image": IMAGES[:1]}}], add_special_tokens=False)[0]


# Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE: images of different sizes (4 to 16 tokens after
# merging), MRoPE positions (Qwen3-VL's interleaved), its deepstack features into its first layer
QWEN_MARK = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_PROMPTS = [
    {"prompt": f"Describe {QWEN_MARK} now", "multi_modal_data": {"image": image(3, 90, 60)}},
    {"prompt": PREFIX + f"{QWEN_MARK} and {QWEN_MARK} differ", "multi_modal_data": {"image": [IMAGES[1], IMAGES[2]]}},
    {"prompt": f"{QWEN_MARK}{QWEN_MARK} then {QWEN_MARK}", "multi_modal_data": {"image": IMAGES}},
    {"prompt": PREFIX + "no image here"},
]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
def qwen(request, tmp_path_factory):
    """(the model's folder, transformers' greedy tokens for QWEN_PROMPTS)"""
    folder = build_tiny_model(tmp_path_factory.mktemp(request.param), request.param, seed=3)
    return folder, hf_qwen_generate(folder, QWEN_PROMPTS)


@pytest.fixture(scope="module")
def qwen25vl(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("qwen2_5_vl_images"), "qwen2_5_vl", seed=3)


def hf_qwen_generate(folder, prompts, device: str = "cpu") -> list[list[int]]:
    """transformers' model on the same token ids and pixels (its processor, but for the
    video processor it holds, is what ImagePrompts runs), with the image tokens' types that
    its MRoPE positions are computed from."""
    import transformers

    from services.tokenizer.images import ImagePrompts
    from shared.hf.image_models import image_model
    from shared.hf.model_folder import read_config

    spec = image_model(folder)
    model_class = getattr(transformers, read_config(folder)["architectures"][0])
    model = model_class.from_pretrained(folder, dtype=torch.float32).to(device)
    image_prompts, out = ImagePrompts(folder, spec), []
    for prompt in prompts:
        images = prompt.get("multi_modal_data", {}).get("image", [])
        ids, features = image_prompts.encode(prompt["prompt"], images if isinstance(images, list) else [images]) \
            if images else (image_prompts.tokenizer(prompt["prompt"])["input_ids"], [])
        ids = torch.tensor([ids], device=device)
        pixels = [torch.from_numpy(np.frombuffer(f.pixel_values, np.float32).reshape(f.shape).copy()) for f in features]
        extra = {"pixel_values": torch.cat(pixels).to(device),
                 "image_grid_thw": torch.tensor([f.grid for f in features], device=device),
                 "mm_token_type_ids": (ids == spec.image_token_id).int()} if features else {}
        generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                                   do_sample=False, eos_token_id=None, **extra)  # (as ignore_eos)
        out.append(generated[0, ids.shape[1]:].tolist())
    return out


@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 20, "long_prefill_token_threshold": 7},
                                    {"num_kv_blocks": 6, "block_size": 16}], ids=["plain", "chunked", "preempted"])
def test_qwen_vl_images_give_transformers_tokens(qwen, engine):
    check_engine(*qwen[:1], QWEN_PROMPTS, qwen[1], engine)


def test_qwen_vl_image_positions_and_features_count(qwen, monkeypatch):
    """Another image; image tokens at plain positions (as transformers without the token
    types); no shift after the images; the sections laid out the other way; no deepstack
    features: each gives other tokens, so the test above can fail on any."""
    from services.worker.vision import mrope
    from services.worker.vision.step_images import StepImages

    folder, reference = qwen
    llm = LLM(str(folder), dtype="float32", enable_prefix_caching=False)  # (each variant computes its own K/V)
    other = dict(QWEN_PROMPTS[0], multi_modal_data={"image": image(8, 90, 60)})
    assert generate_ids(llm, [other]) != reference[:1]
    plain = mrope.mrope_positions
    monkeypatch.setattr(mrope, "mrope_positions", lambda n, images, merge: (np.tile(np.arange(n), (3, 1)), 0))
    assert generate_ids(llm, QWEN_PROMPTS[:3]) != reference[:3]
    monkeypatch.setattr(mrope, "mrope_positions", lambda n, images, merge: (plain(n, images, merge)[0], 0))
    assert generate_ids(llm, QWEN_PROMPTS[:3]) != reference[:3]
    monkeypatch.undo()
    rows = llm.runner.images.mrope
    sections = torch.repeat_interleave(torch.arange(3), torch.tensor([2, 3, 3]))  # (the tiny models' [2, 3, 3])
    interleaved = torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    assert rows.component.tolist() == (interleaved if "qwen3" in str(folder) else sections).tolist()
    monkeypatch.setattr(rows, "component", sections if "qwen3" in str(folder) else interleaved)
    assert generate_ids(llm, QWEN_PROMPTS[:3]) != reference[:3]
    monkeypatch.undo()
    if "qwen3" in str(folder):
        monkeypatch.setattr(StepImages, "add_deepstack", lambda self, layer, hidden: hidden)
        assert generate_ids(llm, QWEN_PROMPTS[:3]) != reference[:3]
        monkeypatch.undo()
    assert generate_ids(llm, QWEN_PROMPTS[:3]) == reference[:3]  # (and all put back, the same LLM as before)


@pytest.mark.parametrize("family", ["gemma3", "qwen2_5_vl"])
def test_a_worker_processes_an_image_file_to_the_replica_s_pixels(family, gemma3, qwen25vl):
    """Served, a request carries its image's file; the worker's pixels from it are the
    tokenizer replica's, bit for bit (their hash checked), for each family's processor."""
    import io

    from services.tokenizer.tokenizer import Tokenizer

    folder, marker = (gemma3, "<start_of_image>") if family == "gemma3" else (qwen25vl, QWEN_MARK)
    buffer = io.BytesIO()
    IMAGES[2].save(buffer, format="PNG")
    tokenizer = Tokenizer(folder)
    ids, served = tokenizer.encode_with_images(f"see {marker}", [buffer.getvalue()])
    offline_ids, offline = tokenizer.image_prompts.encode(f"see {marker}", [Image.open(io.BytesIO(buffer.getvalue()))])
    assert ids == offline_ids and served[0].identifier == offline[0].identifier
    assert served[0].source and not served[0].pixel_values
    pixels = LLM(str(folder), dtype="float32").runner.images._pixels(served[0])
    assert np.array_equal(pixels, np.frombuffer(offline[0].pixel_values, np.float32).reshape(offline[0].shape))


def test_image_requests_keep_speculation_and_structured_outputs(gemma3, reference):
    """n-gram drafts verified exactly on image requests (the same tokens), and a JSON schema
    constrains an image request's output (it parses and fits)."""
    import json

    from shared.sampling_params import StructuredOutputsParams

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1,
            "disable_by_batch_size": None}
    llm = LLM(str(gemma3), dtype="float32", speculative_config=spec)
    assert generate_ids(llm, PROMPTS) == reference
    assert llm.stats().spec_decode_num_draft_tokens > 0
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    text = llm.generate(PROMPTS[1], params)[0].outputs[0].text
    assert isinstance(json.loads(text)["n"], int)


def test_images_on_two_tensor_parallel_ranks(tmp_path):
    """Each rank encodes the step's images itself (the tower replicated) and rotates by the
    same MRoPE rows: Qwen3-VL on two ranks (gloo) gives transformers' tokens."""
    folder = build_tiny_model(tmp_path / "qwen3_vl", "qwen3_vl", seed=3)
    llm = LLM(str(folder), dtype="float32", tensor_parallel_size=2, max_model_len=256, num_kv_blocks=64)
    try:
        assert generate_ids(llm, QWEN_PROMPTS) == hf_qwen_generate(folder, QWEN_PROMPTS)
    finally:
        llm.executor.close()  # (its ranks stopped here, as tests/test_tensor_parallel.py's)
