"""Qwen-VL's MRoPE for prompts with images: each image token turns with three positions
(time, height, width: its place in the image's grid, after the text before it), each
for its section of the head's rotary frequencies; a text token's three are equal, its
ordinary rotary at a position that the images before it have shifted; past the prompt,
the token's index plus the prompt's shift (`delta`), ordinary too (transformers'
get_rope_index, image by image).

So only an image token needs rows the rotary table lacks: the step's such tokens get
rows of their own past the table's positions (`scratch` rows, written each step), and
every token's `positions` entry names its row - which is what every path reads them as
(the CPU kernels, PyTorch, Triton's rotary_and_cache, the decode graphs' buffers): no
attention path changes."""

from __future__ import annotations

import numpy as np
import torch

SCRATCH_ROWS = 16384  # image tokens one step may compute (a 1008x1008 image is 1,296)


def mrope_positions(num_prompt: int, images: list, merge_size: int) -> tuple[np.ndarray, int]:
    """[3, num_prompt] positions of a prompt's tokens, and the shift of the tokens after it."""
    positions = np.empty((3, num_prompt), np.int64)
    current = at = 0
    for image in sorted(images, key=lambda f: f.offset):
        positions[:, at:image.offset] = np.arange(image.offset - at) + current
        current += image.offset - at
        t, h, w = image.grid
        grid = np.stack(np.meshgrid(np.arange(t), np.arange(h // merge_size), np.arange(w // merge_size),
                                    indexing="ij")).reshape(3, -1)
        positions[:, image.offset:image.end] = grid + current
        current += max(h, w) // merge_size
        at = image.end
    positions[:, at:] = np.arange(num_prompt - at) + current
    return positions, int(positions.max()) + 1 - num_prompt if num_prompt else 0


class MRoPERows:
    def __init__(self, rotary, section: tuple[int, ...], merge_size: int, interleaved: bool = False) -> None:
        if sum(section) * 2 != rotary.head_dim:
            raise ValueError(f"mrope_section {list(section)} does not cover a head's {rotary.head_dim // 2} "
                             "rotary frequencies")
        self.rotary, self.merge_size = rotary, merge_size
        # which of (time, height, width) each frequency turns with, for both halves of a head:
        # in sections one after the other (Qwen2.5-VL), or interleaved t, h, w, t, h, w, ...
        # over 3x the height and width sections, time after (Qwen3-VL)
        if interleaved:
            self.component = torch.zeros(rotary.head_dim // 2, dtype=torch.int64)
            for axis in (1, 2):
                self.component[axis:section[axis] * 3:3] = axis
        else:
            self.component = torch.repeat_interleave(torch.arange(len(section)), torch.tensor(section))
        self.base = rotary.cos_cache.shape[0]
        dim = rotary.cos_cache.shape[1]
        # The tables before: kept alive, as the CPU's fused decode layer (models/fused_decode.py)
        # holds their addresses; a decode reads rows both tables hold alike (its position,
        # shifted or not, is never past the table's), never a scratch row.
        self._tables_before = (rotary.cos_cache, rotary.sin_signed_cache)
        rotary.cos_cache = torch.cat([rotary.cos_cache, rotary.cos_cache.new_zeros(SCRATCH_ROWS, dim)])
        rotary.sin_signed_cache = torch.cat([rotary.sin_signed_cache,
                                             rotary.sin_signed_cache.new_zeros(SCRATCH_ROWS, dim)])

    def patch(self, states: list, num_tokens: dict[str, int], positions: np.ndarray) -> None:
        """Each image request's tokens' rows in `positions` (the step's flat host array)."""
        flat, triples, used = 0, [], 0  # (used: scratch rows taken so far this step)
        for state in states:
            n = num_tokens[state.req_id]
            if state.images:
                if state.mrope is None:
                    state.mrope = mrope_positions(state.num_prompt_tokens, state.images, self.merge_size)
                prompt, delta = state.mrope
                ks = np.arange(state.num_computed_tokens, state.num_computed_tokens + n)
                rows = ks + delta
                inside = ks < prompt.shape[1]
                mine = prompt[:, ks[inside]]
                rows[inside] = mine[0]
                mixed = np.flatnonzero(inside)[(mine[0] != mine[1]) | (mine[1] != mine[2])]
                if len(mixed):
                    rows[mixed] = self.base + used + np.arange(len(mixed))
                    triples.append(prompt[:, ks[mixed]].T)
                    used += len(mixed)
                positions[flat:flat + n] = rows
            flat += n
        if triples:
            self._write(np.concatenate(triples))

    def _write(self, triples: np.ndarray) -> None:
        """The scratch rows' cos and signed sin for these (time, height, width) positions."""
        if len(triples) > SCRATCH_ROWS:
            raise ValueError(f"a step computes {len(triples)} image tokens, more than the {SCRATCH_ROWS} "
                             "rotary rows kept for them")
        rotary = self.rotary
        half = rotary.head_dim // 2
        chosen = torch.from_numpy(triples).float()[:, self.component]  # [tokens, half]
        angles = chosen * rotary.inv_freq[None, :]
        emb = torch.cat((angles, angles), -1)
        cos, sin = emb.cos() * rotary.scale, emb.sin() * rotary.scale
        rows = slice(self.base, self.base + len(triples))
        rotary.cos_cache[rows] = cos.to(rotary.cos_cache.device)
        rotary.sin_signed_cache[rows] = torch.cat((-sin[:, :half], sin[:, half:]), -1).to(rotary.cos_cache.device)
