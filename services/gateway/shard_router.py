"""Which scheduler shard (--data-parallel-size) a request goes to, from what the shards
publish: their heartbeats (id, workers, requests held) and their stats (running and
waiting requests, on every change).

Cache first, then load, as SGLang's cache-aware router (shared/prefix_affinity.py). Where
the shards publish KV events (--kv-events-config), a prompt goes to the shard one of whose
workers holds its longest cached prefix (shard_caches.py: what every gateway reads alike),
when that covers at least half its blocks; else, the gateway remembers which shard it sent
each prompt's blocks to (blocks not computed yet, or no events), and a prompt whose longest
remembered prefix covers half its blocks goes there. Either way, not to a shard holding
more than `imbalance_ratio` x the least loaded one's requests (plus `imbalance_slack`). Any
other prompt goes to the least loaded shard. Herding — every gateway sending its burst to
the shard that looked idlest in the last report — is avoided by each gateway counting what
it sent to each shard since that shard's last report, and by ties broken at random. A
plain object: the engine client feeds it and asks it.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass

from services.gateway.shard_caches import ShardCaches
from shared.messages import SchedulerHeartbeat
from shared.prefix_affinity import PrefixAffinity, block_chain


@dataclass(slots=True)
class Shard:
    rank: int
    scheduler_id: str
    epoch: int
    num_workers: int
    num_requests: int  # running + waiting, as last reported
    heard_at: float
    sent_since: int = 0  # routed here by this gateway since that report

    held: int = 0  # this gateway's requests open on it (set at each route)

    @property
    def load(self) -> int:
        # A report resets sent_since, yet may predate requests still on their way to the
        # shard: this gateway's own open requests there are a floor it always knows.
        return max(self.num_requests + self.sent_since, self.held)


class ShardRouter:
    def __init__(self, timeout_s: float = 2.5, imbalance_ratio: float = 1.5, imbalance_slack: int = 4,
                 rng: random.Random | None = None) -> None:
        self.timeout_s = timeout_s
        self.shards: dict[int, Shard] = {}
        self._rng = rng or random.Random()
        self.affinity = PrefixAffinity(ratio=imbalance_ratio, slack=imbalance_slack)
        self.caches = ShardCaches()  # (the shards' KV events, where they publish them)

    def heard(self, beat: SchedulerHeartbeat, now: float) -> str | None:
        """A shard's heartbeat. Returns why its requests must be sent again (a new scheduler
        took the shard over, or it reconnected to NATS and may have lost outputs), else None."""
        shard = self.shards.get(beat.data_parallel_rank)
        if shard is None:
            self.shards[beat.data_parallel_rank] = Shard(beat.data_parallel_rank, beat.scheduler_id, beat.epoch,
                                                         beat.num_workers, beat.num_requests, now)
            return None
        why = None
        if shard.scheduler_id != beat.scheduler_id:
            why = f"scheduler {beat.scheduler_id} took shard {shard.rank} over"
            self.caches.forget(shard.rank)  # (its events start again from 1)
        elif shard.epoch != beat.epoch:
            why = f"the scheduler of shard {shard.rank} reconnected to NATS"
        shard.scheduler_id, shard.epoch, shard.num_workers = beat.scheduler_id, beat.epoch, beat.num_workers
        shard.heard_at = now
        self.reported(shard.rank, beat.num_requests)
        return why

    def answered(self, rank: int, num_workers: int) -> None:
        """A shard's answer to an info query (/health's): its workers as of now, fresher than
        its last heartbeat's, so a deployment that says it is healthy routes to all of it."""
        shard = self.shards.get(rank)
        if shard is not None:
            shard.num_workers = num_workers

    def reported(self, rank: int, num_requests: int) -> None:
        """A shard's own count of its requests (stats, heartbeats): it replaces ours."""
        shard = self.shards.get(rank)
        if shard is not None:
            shard.num_requests, shard.sent_since = num_requests, 0

    def live(self, now: float) -> list[Shard]:
        return [s for s in self.shards.values() if now - s.heard_at <= self.timeout_s]

    def silent(self, now: float) -> list[int]:
        """The shards not heard for longer than the timeout (forgotten here: one that speaks
        again is a new shard)."""
        gone = [rank for rank, s in self.shards.items() if now - s.heard_at > self.timeout_s]
        for rank in gone:
            del self.shards[rank]
            self.caches.forget(rank)
        return gone

    def route(self, prompt_token_ids: list[int], lora_name: str | None, now: float,
              held: Mapping[int, int] | None = None, cache_salt: str | None = None, mm_features=()) -> int:
        """The shard for a request: a live one with workers (else any live one, which holds
        it until a worker joins; none heard yet: shard 0). `held`: this gateway's open
        requests by shard (its stream ledger's); `mm_features`: its images, part of its blocks."""
        live = self.live(now)
        for shard in live:
            shard.held = (held or {}).get(shard.rank, 0)
        candidates = [s for s in live if s.num_workers > 0] or live
        if not candidates:
            return 0
        self._rng.shuffle(candidates)  # (ties at random: gateways do not all pick the same)
        chain = block_chain(prompt_token_ids, lora_name, mm_features=mm_features)
        chosen = None if lora_name is not None else self._cached(prompt_token_ids, cache_salt, candidates,
                                                                 mm_features)
        if chosen is None:
            chosen = self.affinity.choose(chain, candidates, key=lambda s: s.rank, load=lambda s: s.load)
        else:
            self.affinity.record(chain, chosen.rank)
        chosen.sent_since += 1
        return chosen.rank

    def _cached(self, prompt_token_ids: list[int], cache_salt: str | None, candidates: list[Shard],
                mm_features=()) -> Shard | None:
        """The shard whose cache (its KV events) holds the longest prefix of the prompt, at
        least half its blocks, within the imbalance bound; None: none does. (An adapter's
        blocks are keyed by its id on the scheduler: those go by this gateway's memory.)"""
        chain = self.caches.chain(prompt_token_ids, cache_salt, mm_features)
        if not chain:
            return None
        depth = {s.rank: self.caches.cached_blocks(s.rank, chain) for s in candidates}
        best = max(candidates, key=lambda s: (depth[s.rank], -s.load))
        least = min(s.load for s in candidates)
        if 2 * depth[best.rank] < len(chain) or best.load > least * self.affinity.ratio + self.affinity.slack:
            return None
        return best
