"""What this gateway has asked of the engine and had back, per engine request: the
truth of each stream it serves.

The scheduler holds only scheduling state, so when it dies (or restarts under a new id)
its requests are not lost: the gateway sends each unfinished one again as a resumed
request, with the tokens its client has already received, and the stream goes on from
there. The same resume mends a bus that lost messages: every output says the position of
its first token, so a repeat is trimmed here and a gap is noticed (and resumed: the
scheduler sends again what came after the tokens we have). No token is repeated or
skipped either way.
"""

from __future__ import annotations

import time

import msgspec

from shared.messages import EngineCoreOutput, EngineCoreRequest


class StreamLedger:
    def __init__(self, resume_every_s: float = 1.0) -> None:
        # request id -> (the request as first submitted, the tokens received since)
        self._open: dict[str, tuple[EngineCoreRequest, list[int]]] = {}
        self._resumed_at: dict[str, float] = {}  # a gap's resume sent, its answer not yet in
        self.shard: dict[str, int] = {}  # request id -> the scheduler shard it was sent to
        self.resume_every_s = resume_every_s

    def __len__(self) -> int:
        return len(self._open)

    def submitted(self, request: EngineCoreRequest, shard: int = 0) -> None:
        self._open[request.request_id] = (request, list(request.output_token_ids))
        self.shard[request.request_id] = shard

    def on_shard(self, shard: int) -> list[str]:
        """The open requests sent to one shard."""
        return [request_id for request_id, rank in self.shard.items() if rank == shard]

    def received(self, output: EngineCoreOutput, now: float | None = None) -> tuple[EngineCoreOutput | None, bool]:
        """What of `output` is new (None: nothing), and whether to resume its request
        because outputs before it were lost."""
        entry = self._open.get(output.request_id)
        if entry is None:
            return output, False  # not one this ledger tracks (or already over)
        tokens = entry[1]
        have = len(tokens)
        if output.index > have:  # outputs were lost: ask again, at most once a second
            now = time.monotonic() if now is None else now
            if now - self._resumed_at.get(output.request_id, -1e9) < self.resume_every_s:
                return None, False
            self._resumed_at[output.request_id] = now
            return None, True
        skip = have - output.index
        if skip:
            if skip >= len(output.new_token_ids) and output.finish_reason is None:
                return None, False  # all of it had already come
            output = msgspec.structs.replace(
                output, new_token_ids=output.new_token_ids[skip:], new_logprobs=output.new_logprobs[skip:],
                index=have,
            )
        self._resumed_at.pop(output.request_id, None)
        tokens.extend(output.new_token_ids)
        if output.finish_reason is not None:
            self.forget([output.request_id])
        return output, False

    def forget(self, request_ids: list[str]) -> None:
        """Closed, finished or aborted here (a stop string): never to be resumed."""
        for request_id in request_ids:
            self._open.pop(request_id, None)
            self._resumed_at.pop(request_id, None)
            self.shard.pop(request_id, None)

    def resumed(self, request_ids: list[str] | None = None) -> list[EngineCoreRequest]:
        """The open requests (all, or those named) as resumes from what they have."""
        ids = list(self._open) if request_ids is None else [r for r in request_ids if r in self._open]
        return [
            msgspec.structs.replace(self._open[r][0], output_token_ids=list(self._open[r][1]), resume=True)
            for r in ids
        ]
