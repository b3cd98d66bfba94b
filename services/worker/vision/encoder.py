"""A worker's image encoder and its cache: each image encoded once, by its identifier (a
hash of its pixels), for every chunk and request that shows it (vLLM's encoder cache).

Images are encoded at the first step that computes any of their placeholders, those of
one step together, in batches of one shape. The cache holds up to CACHE_TOKENS rows of
embeddings (least recently used out first); an image still to be computed that was
evicted is encoded again from the pixels its request carries.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from services.worker.loader import iter_weights
from services.worker.vision.mrope import MRoPERows
from services.worker.vision.step_images import StepImages
from shared.config import WorkerConfig
from shared.hf.image_models import image_model, read_image
from shared.messages import NewRequestData
from shared.messages.images import pixel_hash

# Embedding rows the cache keeps: 64 of Gemma 3's 256-token images (gemma-3-27b: 5376
# wide, 176 MB in bfloat16)
CACHE_TOKENS = 16384


class ImageEncoder:
    def __init__(self, module: torch.nn.Module, bidirectional: bool, dtype: torch.dtype,
                 device: torch.device, folder: str | Path = "") -> None:
        self.module = module
        self.folder = folder  # (its image processor, for images that come as files: read at the first)
        self._processor = None
        self.bidirectional = bidirectional
        self.dtype, self.device = dtype, device
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_encoded = 0  # images run through the tower (the cache's misses)
        self.mrope: MRoPERows | None = None  # Qwen-VL's image positions (mrope.py)

    def embeddings(self, images: list) -> list[torch.Tensor]:
        """Each image's [length, hidden] embeddings, from the cache or encoded now."""
        todo = list({f.identifier: f for f in images if f.identifier not in self.cache}.values())
        if todo:
            pixels = [torch.from_numpy(self._pixels(f)).to(self.device, self.dtype) for f in todo]
            for feature, out in zip(todo, self.module.encode(pixels, [f.grid for f in todo])):
                if out.shape[0] != feature.length:
                    raise ValueError(f"an image encodes to {out.shape[0]} tokens but its prompt holds {feature.length} "
                                     "placeholders")
                self.cache[feature.identifier] = out
                self.num_encoded += 1
        found = []
        for feature in images:
            self.cache.move_to_end(feature.identifier)
            found.append(self.cache[feature.identifier])
        while sum(e.shape[0] for e in self.cache.values()) > CACHE_TOKENS and len(self.cache) > len(images):
            self.cache.popitem(last=False)
        return found

    def _pixels(self, feature) -> np.ndarray:
        """An image's processed pixels: as they came (offline), or processed here from its
        file by the processor the tokenizer replica ran, and checked to be those it hashed."""
        if feature.pixel_values or not feature.source:  # (a copy: torch takes no read-only buffer)
            return np.frombuffer(feature.pixel_values, np.float32).reshape(feature.shape).copy()
        if self._processor is None:
            from transformers import AutoImageProcessor

            self._processor = AutoImageProcessor.from_pretrained(str(self.folder), backend="pil")
        out = self._processor(images=[read_image(feature.source, 0)], return_tensors="np")["pixel_values"]
        pixels = np.ascontiguousarray(out if feature.grid else out[0], dtype=np.float32)  # (Qwen's: rows of patches)
        if pixel_hash(pixels.shape, pixels.tobytes(), feature.grid) != feature.identifier:
            raise ValueError("an image's pixels here differ from those its tokenizer replica processed (another "
                             "processor or pillow version?)")
        return pixels

    def for_step(self, states: list, num_tokens: dict[str, int], drafts: dict[str, list[int]],
                 positions) -> StepImages | None:
        """The step's placeholders' embeddings and, for a family whose images attend both
        ways, each row's image spans; None for a step that computes no placeholder. With
        MRoPE, the image requests' rotary rows in `positions` first (every step: their
        decodes are shifted too)."""
        if self.mrope is not None:
            self.mrope.patch(states, num_tokens, positions)
        wanted = []  # (flat token index of the piece's first, attention row, image, first, end position)
        flat = row = 0
        for state in states:
            n = num_tokens[state.req_id]
            start = state.num_computed_tokens
            for image in state.images:
                first, end = max(image.offset, start), min(image.end, start + n)
                if first < end:
                    wanted.append((flat + first - start, row, image, first, end))
            flat += n
            row += 1 + len(drafts[state.req_id]) if state.req_id in drafts else 1
        if not wanted:
            return None
        embeddings = self.embeddings([w[2] for w in wanted])
        rows = torch.cat([torch.arange(at, at + end - first) for at, _, _, first, end in wanted])
        values = torch.cat([e[first - image.offset:end - image.offset]
                            for e, (_, _, image, first, end) in zip(embeddings, wanted)])
        spans: dict[int, list[tuple[int, int]]] | None = None
        if self.bidirectional:
            spans = {}
            for _, r, image, _, _ in wanted:
                spans.setdefault(r, []).append((image.offset, image.end))
        return StepImages(rows.to(self.device), values, spans)


def image_encoder(folder: str | Path, dtype: torch.dtype, device: torch.device, config: WorkerConfig,
                  model=None) -> ImageEncoder | None:
    """The encoder of a checkpoint that takes images (shared/hf/image_models.py), its
    weights read from the checkpoint (random ones with load_format "dummy"); None for one
    that takes none, or where `--limit-mm-per-prompt '{"image": 0}'` asks for the language
    model alone (vLLM's: the tower's weights are never read, its memory left to the KV cache)."""
    image = image_model(folder)
    if image is None or config.limit_mm_per_prompt.get("image") == 0:
        return None
    from transformers import AutoConfig

    from services.worker.vision.gemma3 import Gemma3ImageEncoder

    from services.worker.vision.qwen2_5_vl import Qwen25VLImageEncoder

    hf_config = AutoConfig.from_pretrained(str(folder))
    module = {"gemma3": Gemma3ImageEncoder, "qwen2_vl": Qwen25VLImageEncoder, "qwen2_5_vl": Qwen25VLImageEncoder,
              "qwen3_vl": Qwen25VLImageEncoder}[image.family](hf_config)
    if config.load_format != "dummy":
        module.load_weights(iter_weights(Path(folder), module.reads))
    encoder = ImageEncoder(module.to(device, dtype).eval(), image.bidirectional, dtype, device, folder)
    if image.mrope_section is not None:  # (`model`: the decoder, whose rotary table gets the image rows)
        encoder.mrope = MRoPERows(model.model.rotary, image.mrope_section, image.merge_size, image.mrope_interleaved)
    return encoder


def image_refusal(new: NewRequestData, encoder: ImageEncoder | None) -> str | None:
    """Why a request with images cannot run on a worker with no image encoder (the gateway
    refuses them first; a worker of another deployment's flags may still be sent one)."""
    if new.mm_features and encoder is None:
        return ("this worker has no image encoder (a model that takes no images, or --limit-mm-per-prompt "
                "'{\"image\": 0}': the language model alone)")
    return None
