"""A conversation's images for `LLM.chat`, as vLLM's offline chat takes them: `image_url`
parts (a base64 data URL, or an http(s) URL fetched here) and `image_pil` parts (a PIL
image). Each becomes {"type": "image"}, which the template renders as the model marks an
image (services/tokenizer/tokenizer.py's chat_messages)."""

from __future__ import annotations

from typing import Any

from shared.hf.image_models import data_url_bytes, read_image

FETCH_TIMEOUT_S = 5.0  # (the gateway's: services/gateway/media.py)


def take_images(messages: list[dict]) -> tuple[list[dict], list]:
    """The messages with each image part {"type": "image"}, and the images (PIL) in order."""
    images, out = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("image_url", "image_pil"):
                parts.append(part)
                continue
            images.append(_image(part, kind, f"messages[{i}].content[{j}]"))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    return out, images


def _image(part: dict[str, Any], kind: str, where: str):
    from PIL import Image

    if kind == "image_pil":
        if not isinstance(part.get("image_pil"), Image.Image):
            raise TypeError(f"{where}.image_pil must be a PIL image")
        return part["image_pil"]
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
        raise ValueError(f"{where}.image_url.url must be a string")
    try:
        if url.startswith("data:"):
            return read_image(data_url_bytes(url), 0)
        if url.startswith(("http://", "https://")):
            import httpx

            response = httpx.get(url, timeout=FETCH_TIMEOUT_S, follow_redirects=True)
            response.raise_for_status()
            return read_image(response.content, 0)
    except (ValueError, OSError) as exc:  # (httpx's errors are OSErrors' kin: HTTPError is not; below)
        raise ValueError(f"{where}.image_url: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - httpx.HTTPError and its kin
        raise ValueError(f"{where}.image_url: fetching it failed: {exc}") from None
    raise ValueError(f"{where}.image_url.url must be a data: or http(s): URL")
