"""A chat's images, as vLLM's API server reads them: each `image_url` content part's URL -
a data: URL (base64), an http(s) URL fetched here (only from --allowed-media-domains when
it names any; with a timeout and the body's size cap; no redirect past that list), or a
file: URL under --allowed-local-media-path - read into the image's file, its part left as
{"type": "image"} for the tokenizer replica that places it. Every bad image is a 400
naming where it is, before anything reaches a tokenizer or the engine. The files go on
as they are; a replica decodes and processes them (services/tokenizer/images.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

import httpx

from services.gateway.errors import BadRequest
from shared.config import GatewayConfig
from shared.hf.image_models import data_url_bytes

FETCH_TIMEOUT_S = 5.0  # vLLM's VLLM_IMAGE_FETCH_TIMEOUT


async def image_files(messages: list[Any], config: GatewayConfig) -> tuple[list[Any], list[bytes]]:
    """The messages with each image_url part as {"type": "image"}, and the images' files in
    the order they appear (messages that hold none are returned as they are)."""
    urls: list[tuple[str, str]] = []  # (where, url)
    out = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list) or not any(_is_image(p) for p in content):
            out.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            if not _is_image(part):
                parts.append(part)
                continue
            where = f"messages[{i}].content[{j}].image_url"
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str) or not url:
                raise BadRequest(f"{where}.url must be a non-empty string", "messages")
            urls.append((where, url))
            parts.append({"type": "image"})
        out.append({**message, "content": parts})
    if not urls:
        return messages, []
    if config.no_images_why is not None:
        raise BadRequest(config.no_images_why, "messages")
    limit = config.limit_mm_per_prompt.get("image")
    if limit is not None and len(urls) > limit:
        raise BadRequest(f"the messages hold {len(urls)} images, more than --limit-mm-per-prompt's {limit}",
                         "messages")
    files = await asyncio.gather(*(_read(where, url, config) for where, url in urls))
    if sum(map(len, files)) > config.max_body_bytes:
        raise BadRequest(f"the images' files come to {sum(map(len, files))} bytes, more than a request carries "
                         f"({config.max_body_bytes}, --max-body-bytes)", "messages")
    return out, list(files)


def _is_image(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "image_url"


async def _read(where: str, url: str, config: GatewayConfig) -> bytes:
    scheme = url.split(":", 1)[0].lower()
    if scheme == "data":
        return _data_url(where, url)
    if scheme in ("http", "https"):
        return await _fetch(where, url, config)
    if scheme == "file":
        return _local_file(where, url, config)
    raise BadRequest(f"{where}.url must be a data:, http(s): or file: URL", "messages")


def _data_url(where: str, url: str) -> bytes:
    try:
        return data_url_bytes(url)
    except ValueError as exc:
        raise BadRequest(f"{where}.url: {exc}", "messages") from None


async def _fetch(where: str, url: str, config: GatewayConfig) -> bytes:
    host = urlparse(url).hostname or ""
    allowed = config.allowed_media_domains
    if allowed and host not in allowed:
        raise BadRequest(f"{where}.url: {host!r} is not one of the hosts images may come from "
                         "(--allowed-media-domains)", "messages")
    cap = config.max_body_bytes
    try:
        # (redirects followed only where any host may serve: one could lead past the list)
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=not allowed) as client:
            async with client.stream("GET", url) as response:
                if response.status_code != 200:
                    raise BadRequest(f"{where}.url: fetching it answered HTTP {response.status_code}", "messages")
                body = bytearray()
                async for chunk in response.aiter_bytes():
                    body += chunk
                    if len(body) > cap:
                        raise BadRequest(f"{where}.url: the image is more than {cap} bytes (--max-body-bytes)",
                                         "messages")
                return bytes(body)
    except httpx.TimeoutException:
        raise BadRequest(f"{where}.url: fetching it took more than {FETCH_TIMEOUT_S:.0f} s", "messages") from None
    except httpx.HTTPError as exc:
        raise BadRequest(f"{where}.url: fetching it failed: {exc}", "messages") from None


def _local_file(where: str, url: str, config: GatewayConfig) -> bytes:
    root = config.allowed_local_media_path
    if root is None:
        raise BadRequest(f"{where}.url: file: URLs are not allowed (--allowed-local-media-path)", "messages")
    path = Path(unquote(urlparse(url).path)).resolve()
    if not path.is_relative_to(Path(root).resolve()):
        raise BadRequest(f"{where}.url: the file is not under --allowed-local-media-path", "messages")
    try:
        if path.stat().st_size > config.max_body_bytes:
            raise BadRequest(f"{where}.url: the image is more than {config.max_body_bytes} bytes", "messages")
        return path.read_bytes()
    except OSError as exc:
        raise BadRequest(f"{where}.url: cannot read the file: {exc.strerror}", "messages") from None
