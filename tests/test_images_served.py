"""Images in, served: `llmbus serve --workers 2` with a tiny random Gemma 3 and the openai
client. A chat's image_url parts (data URLs, a file under --allowed-local-media-path) give
transformers' greedy text for the same chat; a worker SIGKILLed under image streams loses
none of them (the other encodes their images again, from the files they carry); a bad
image, one from a host not allowed, one too many, a file outside the folder are each a
400 naming the messages, and the deployment serves on."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import time
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from deployment import llmbus_serve
from llmbus.deploy.serve import live_children
from tiny_models import build_tiny_model

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MAX_NEW = 10


def image(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


def png(img: Image.Image) -> bytes:
    out = io.BytesIO()
    img.save(out, format="PNG")
    return out.getvalue()


def data_url(img: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(img)).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(png(image(5, 50, 40)))
    (folder / "not-an-image.png").write_bytes(b"GIF89a but not really")
    return folder


@pytest.fixture(scope="module")
def served(tmp_path_factory, media):
    model = build_tiny_model(tmp_path_factory.mktemp("gemma3_served"), "gemma3_multimodal", seed=4)
    proc, url = llmbus_serve(
        ["--model", str(model), "--served-model-name", "tiny", "--allowed-local-media-path", str(media),
         "--allowed-media-domains", "images.example", "--limit-mm-per-prompt", json.dumps({"image": 2}),
         "--dtype", "float32", "--workers", "2"],
        tmp_path_factory.mktemp("serve") / "stderr.log")
    yield model, url, proc
    if proc.poll() is None:
        proc.kill()


def hf_chat_text(folder, content: str, images: list[Image.Image]) -> str:
    """transformers' greedy reply to one user message whose images the text marks."""
    from transformers import AutoProcessor, Gemma3ForConditionalGeneration

    processor = AutoProcessor.from_pretrained(folder, backend="pil")
    text = processor.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                   add_generation_prompt=True)
    inputs = processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    model = Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32)
    ids = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)  # (as ignore_eos)
    return processor.tokenizer.decode(ids[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def chat(client, parts: list[dict], **options):
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                          max_tokens=MAX_NEW, temperature=0, extra_body={"ignore_eos": True},
                                          **options)


def test_image_parts_give_transformers_text(served, media):
    import openai

    model, url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    first, second = image(0, 40, 30), image(1, 64, 48)
    parts = [{"type": "text", "text": "Compare"}, image_part(data_url(first)), image_part(data_url(second))]
    got = chat(client, parts).choices[0].message.content
    assert got == hf_chat_text(model, "Compare\n<start_of_image>\n<start_of_image>", [first, second])
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, parts, stream=True) if c.choices)
    assert streamed == got
    # A file under the allowed folder reads as the same image would in a data URL.
    cat = Image.open(media / "cat.png")
    from_file = chat(client, [image_part(f"file://{media / 'cat.png'}"), {"type": "text", "text": "What?"}])
    assert from_file.choices[0].message.content == hf_chat_text(model, "<start_of_image>\nWhat?", [cat])


def test_the_responses_api_takes_input_image_parts(served):
    """OpenAI's Responses API, as the chat it means: input_image parts are image_url parts."""
    import openai

    _, url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    picture = data_url(image(2, 33, 44))
    response = client.responses.create(model="tiny", max_output_tokens=MAX_NEW, temperature=0, store=False, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Name it"},
                                     {"type": "input_image", "image_url": picture}]}])
    chat = client.chat.completions.create(model="tiny", max_tokens=MAX_NEW, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Name it"}, image_part(picture)]}])
    assert response.output_text == chat.choices[0].message.content
    # (the image's tokens counted in both: its four placeholders among them)
    assert response.usage.input_tokens == chat.usage.prompt_tokens > len("Name it".split()) + 4


def test_bad_images_are_400s_naming_the_messages(served, media, tmp_path):
    import openai

    _, url, _ = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    # A host that serves a real image, but is not one of --allowed-media-domains.
    (tmp_path / "dog.png").write_bytes(png(image(6, 20, 20)))
    server = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        local = f"http://127.0.0.1:{server.server_address[1]}/dog.png"
        cases = {
            "not one of the hosts": [image_part(local)],
            "more than --limit-mm-per-prompt": [image_part(data_url(image(i, 8, 8))) for i in range(3)],
            "cannot be read as an image": [image_part(f"file://{media / 'not-an-image.png'}")],
            "not under --allowed-local-media-path": [image_part(f"file://{tmp_path / 'dog.png'}")],
            "not base64": [image_part("data:image/png;base64,@@@")],
            "must be a data:, http(s): or file: URL": [image_part("ftp://images.example/x.png")],
        }
        for why, parts in cases.items():
            with pytest.raises(openai.BadRequestError) as caught:
                chat(client, parts)
            assert why in caught.value.message and caught.value.param == "messages", why
    finally:
        server.shutdown()
    assert chat(client, [{"type": "text", "text": "still serving"}]).choices[0].message.content


def test_a_worker_killed_under_image_streams_loses_none(served):
    import openai

    _, url, proc = served
    chats = [[{"type": "text", "text": f"picture {i}"}, image_part(data_url(image(20 + i, 30 + i, 40)))]
             for i in range(8)]
    request = {"max_tokens": 160, "temperature": 0, "extra_body": {"ignore_eos": True}}
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    expected = [client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": parts}],
                                               **request).choices[0].message.content for parts in chats]
    victim = live_children(proc.pid, "worker")[0]

    async def stream_all() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        started = 0

        async def one(parts) -> str:
            nonlocal started
            text, first = "", True
            stream = await aclient.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": parts}], stream=True, **request)
            async for chunk in stream:
                text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
                if first:
                    first, started = False, started + 1
                    if started == len(chats):
                        victim.kill()
            return text

        try:
            return await asyncio.gather(*(one(parts) for parts in chats))
        finally:
            await aclient.close()

    assert asyncio.run(stream_all()) == expected
    assert not victim.is_running() or victim.status() == "zombie"
    deadline = time.monotonic() + 120
    while len(live_children(proc.pid, "worker")) < 2:  # (the supervisor starts it again)
        assert time.monotonic() < deadline, "the killed worker did not come back"
        time.sleep(0.2)
