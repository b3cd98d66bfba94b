"""Where recent prompts were sent, by their prefix: the memory of a cache-aware router.

A gateway choosing a scheduler shard, and a shard choosing one of its workers, both want
a prompt to go where its prefix is (or is about to be) cached. Before a block is computed
no prefix cache knows it, so a burst of requests sharing a prefix would spread over every
target; remembering where each prompt's blocks were *sent* keeps the burst together. The
rule is SGLang's cache-aware one: the target sent the longest prefix, when that covers at
least half the prompt's blocks and its load is within `ratio` x the least loaded target's
(plus `slack`); otherwise the least loaded.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from shared.block_hashes import image_keys

BLOCK_TOKENS = 16  # the prefix cache's block (--block-size's default)
MAX_BLOCKS = 64  # a prompt's first 1,024 tokens say where it is cached


def block_chain(token_ids: Sequence[int], salt: Hashable = None, block_tokens: int = BLOCK_TOKENS,
                mm_features=()) -> list[int]:
    """Hashes of a prompt's full blocks, each over the blocks before it (its prefix), as
    the prefix cache keys them; `salt` (a LoRA adapter, a cache salt) starts another chain,
    and the images whose placeholders lie in a block are part of it (other images, other K/V)."""
    chain, parent = [], hash(salt)
    end = min(len(token_ids), MAX_BLOCKS * block_tokens)
    for start in range(0, end - block_tokens + 1, block_tokens):
        images = image_keys(mm_features, start, start + block_tokens) if mm_features else b""
        parent = hash((parent, tuple(token_ids[start:start + block_tokens]), images))
        chain.append(parent)
    return chain


class PrefixAffinity:
    def __init__(self, capacity: int = 200_000, ratio: float = 1.5, slack: int = 4) -> None:
        self.capacity = capacity  # block hashes remembered, least recently used forgotten
        self.ratio = ratio
        self.slack = slack
        self._sent: OrderedDict[int, Hashable] = OrderedDict()

    def choose(self, chain: list[int], targets: Sequence, key: Callable, load: Callable) -> object:
        """Of `targets` (each named by `key(target)`), where a prompt of this `chain` goes,
        by `load(target)`. Remembers the choice."""
        least = min(load(t) for t in targets)
        by_key = {key(t): t for t in targets}
        chosen = None
        for depth in range(len(chain), 0, -1):
            target = by_key.get(self._sent.get(chain[depth - 1]))
            if target is not None:
                if 2 * depth >= len(chain) and load(target) <= least * self.ratio + self.slack:
                    chosen = target
                break
        if chosen is None:
            chosen = next(t for t in targets if load(t) == least)
        self.record(chain, key(chosen))
        return chosen

    def record(self, chain: list[int], target: Hashable) -> None:
        for block in chain:
            self._sent[block] = target
            self._sent.move_to_end(block)
        while len(self._sent) > self.capacity:
            self._sent.popitem(last=False)
