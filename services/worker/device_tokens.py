"""Tokens a step sampled that are still on the device, read where the next step needs
them (its input ids, penalties' counts, bad words) without a copy to the host."""

from __future__ import annotations

import torch

from services.worker.host_values import to_device


def gather_device_tokens(places: list[tuple[int, tuple]]) -> list[tuple[list[int], torch.Tensor]]:
    """Tokens still on the device, each given as (key, its `pending_token` place: the
    sampling step's ids tensor and a row): one gather per such step ->
    [(keys, their tokens on that step's device)]."""
    if not places:
        return []
    source = places[0][1][0]
    if all(place[0] is source for _, place in places):  # one step sampled them all: the usual case
        rows = [place[1] for _, place in places]
        return [([key for key, _ in places], source[to_device(rows, source.device)])]
    by_source: dict[int, tuple[torch.Tensor, list[int], list[int]]] = {}
    for key, (source, row) in places:
        entry = by_source.setdefault(id(source), (source, [], []))
        entry[1].append(key)
        entry[2].append(row)
    return [(keys, source[to_device(rows, source.device)]) for source, keys, rows in by_source.values()]


def read_device_tokens(input_ids: torch.Tensor, from_device: list[tuple[int, tuple]] | torch.Tensor) -> None:
    """Fill the input ids of tokens still on the device (flat index, place) from the
    steps that sampled them; or, given one step's ids (`LaunchedStep.fed_back`), the first
    input ids from them as they lie."""
    if isinstance(from_device, torch.Tensor):
        input_ids[: len(from_device)].copy_(from_device)
        return
    for flats, tokens in gather_device_tokens(from_device):
        input_ids[to_device(flats, input_ids.device)] = tokens.to(input_ids.device)
