"""`llmbus bench images`: what an image costs, on a random-weight Gemma 3 shaped to run on a
CPU (a SigLIP tower over 448x448 images in patches of 14, pooled to 256 tokens, before a
small language model; `--smoke`: tiny), in one run:

- a tokenizer replica's preprocessing: an image file (a PNG the size of `--image-size`)
  read, resized and normalized by the processor, its placeholders expanded: images a
  second, one process;
- the worker's own processing of a file it has not encoded (files, not pixels, ride the
  bus: docs/features/multimodal_inputs.md): milliseconds an image;
- the encoder (tower and projector): milliseconds an image;
- TTFT of a one-image request (a new image each time: the encoder runs) against the same
  request with its image in the encoder cache, and the encoder's share of the first.
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path

VISION = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4,
          "image_size": 448, "patch_size": 14}
TEXT = {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "head_dim": 64, "sliding_window": 512, "max_position_embeddings": 4096}
SMOKE_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                "image_size": 56, "patch_size": 14}
SMOKE_TEXT = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16}
IMAGE_TOKENS = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}


def add_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tokenizer-from", default=None,
                        help="a model folder whose tokenizer the random model takes (default: SmolLM2's)")
    parser.add_argument("--image-size", type=int, nargs=2, default=(640, 480), metavar=("WIDTH", "HEIGHT"),
                        help="the images' files, before the processor resizes them")
    parser.add_argument("--repeat", type=int, default=8, help="images timed in each measurement")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to test the bench itself")


def random_gemma3(folder: Path, tokenizer_from: Path, vision: dict, text: dict, seed: int) -> Path:
    """A Gemma 3 multimodal checkpoint with random weights, a real tokenizer (with Gemma 3's
    image tokens added) and transformers' processor (its PIL backend)."""
    import torch
    from transformers import (AutoTokenizer, Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor,
                              Gemma3TextConfig, SiglipVisionConfig)
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from, extra_special_tokens=IMAGE_TOKENS)
    vocab = len(tokenizer)
    torch.manual_seed(seed)
    side = vision["image_size"] // vision["patch_size"]
    tokens = (side // 2) ** 2  # (pooled 2x2, as Gemma 3's 64x64 patches to 16x16)
    config = Gemma3Config(text_config=Gemma3TextConfig(**text, vocab_size=vocab).to_dict(),
                          vision_config=SiglipVisionConfig(**vision).to_dict(), mm_tokens_per_image=tokens,
                          image_token_index=tokenizer.image_token_id, boi_token_index=tokenizer.boi_token_id,
                          eoi_token_index=tokenizer.eoi_token_id, eos_token_id=tokenizer.eos_token_id,
                          bos_token_id=tokenizer.bos_token_id)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():  # (the projector starts at zero)
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.05)
    model.save_pretrained(folder)
    size = {"height": vision["image_size"], "width": vision["image_size"]}
    Gemma3Processor(image_processor=Gemma3ImageProcessorPil(size=size), tokenizer=tokenizer,
                    image_seq_length=tokens).save_pretrained(folder)
    return folder


def png(seed: int, width: int, height: int) -> bytes:
    import numpy as np
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def per_item(fn, items) -> list[float]:
    """Seconds each call of fn on each item took."""
    times = []
    for item in items:
        start = time.perf_counter()
        fn(item)
        times.append(time.perf_counter() - start)
    return times


def run(args: argparse.Namespace) -> int:
    import torch

    from llmbus import LLM, SamplingParams
    from llmbus.cli.args import engine_kwargs
    from llmbus.model_fetch import resolve_model
    from services.tokenizer.tokenizer import Tokenizer

    vision, text = (SMOKE_VISION, SMOKE_TEXT) if args.smoke else (VISION, TEXT)
    repeat = 2 if args.smoke else args.repeat
    width, height = args.image_size
    with tempfile.TemporaryDirectory(prefix="llmbus-images-bench-") as tmp:
        folder = random_gemma3(Path(tmp) / "gemma3", resolve_model(args.tokenizer_from), vision, text, args.seed)
        files = [png(args.seed + i, width, height) for i in range(3 * repeat + 2)]
        # A tokenizer replica's work: the file read, processed, its placeholders expanded.
        replica = Tokenizer(folder)
        prompt = "Describe <start_of_image> in a word."
        replica.encode_with_images(prompt, files[:1])  # (the processor read once, as a replica's first)
        preprocess = per_item(lambda f: replica.encode_with_images(prompt, [f]), files[1:repeat + 1])
        # No prefix cache: each timed request computes its whole prompt.
        llm = LLM(str(folder), **{**engine_kwargs(args), "enable_prefix_caching": False})
        encoder = llm.runner.images
        _, features = replica.encode_with_images(prompt, files[repeat + 1:repeat + 2])
        encoder.embeddings(features)  # (the worker's processor read, and the tower's first run)
        unseen = [replica.encode_with_images(prompt, [f])[1][0] for f in files[repeat + 2:2 * repeat + 2]]
        reprocess = per_item(encoder._pixels, unseen)
        pixels = [torch.from_numpy(encoder._pixels(features[0]))[None].to(encoder.device, encoder.dtype)]
        encode = per_item(lambda p: encoder.module(p), pixels * repeat)
        params = SamplingParams(temperature=0, max_tokens=1)

        def ttft(image_file: bytes) -> None:
            from PIL import Image

            llm.generate({"prompt": prompt, "multi_modal_data": {"image": Image.open(io.BytesIO(image_file))}},
                         params, use_tqdm=False)

        cold, warm = [], []
        for image_file in files[2 * repeat + 2:3 * repeat + 2]:
            cold += per_item(ttft, [image_file])  # a new image: encoded
            warm += per_item(ttft, [image_file])  # the same again: from the encoder cache
        tokens = len(replica.encode_with_images(prompt, files[:1])[0])

    def ms(seconds: list[float]) -> float:
        return 1e3 * statistics.median(seconds)

    print(f"model: Gemma 3-shaped, random weights; tower {vision['num_hidden_layers']} layers of "
          f"{vision['hidden_size']} over {vision['image_size']}x{vision['image_size']} in patches of "
          f"{vision['patch_size']} ({(vision['image_size'] // vision['patch_size']) ** 2} patches, "
          f"{encoder.cache and next(iter(encoder.cache.values())).shape[0]} tokens an image); language model "
          f"{text['num_hidden_layers']} layers of {text['hidden_size']}; dtype {llm.runner.dtype}, threads "
          f"{torch.get_num_threads()}; image files {width}x{height} PNG; medians of {repeat}")
    print(f"tokenizer replica: {1 / statistics.median(preprocess):.1f} images/s ({ms(preprocess):.1f} ms an image: "
          "read, processed, placeholders expanded)")
    print(f"worker, processing a file it has not encoded: {ms(reprocess):.1f} ms an image")
    print(f"encoder (tower + projector): {ms(encode):.1f} ms an image")
    print(f"TTFT of a one-image request: {ms(cold):.1f} ms with the image new, {ms(warm):.1f} ms from the encoder "
          f"cache (the prompt: {tokens} tokens); the encoder's share {1 - ms(warm) / ms(cold):.0%}")
    return 0
