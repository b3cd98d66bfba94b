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
from shared.messages import ImageFeature
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


def hf_generate(folder, prompts, **processing) -> list[list[int]]:
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder, backend="pil")
    model = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    out = []
    for prompt in prompts:
        images = prompt.get("multi_modal_data", {}).get("image")
        inputs = processor(text=prompt["prompt"], images=images, return_tensors="pt", **processing)
        ids = model.generate(**inputs, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, do_sample=False)
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
    llm = LLM(str(gemma3), dtype="float32", **engine)
    assert generate_ids(llm, PROMPTS) == reference
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
PARTS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
                  "{% else %}{% for item in m['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
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
