"""What this gateway has asked of the engine and had back, per engine request: the
truth of each stream it serves.

The scheduler holds only scheduling state, so when it dies (or restarts under a new id)
its requests are not lost: the gateway sends each unfinished one again to the next
scheduler as a resumed request, with the tokens its client has already received, and
the stream goes on from there with no token repeated or skipped.
"""

from __future__ import annotations

import msgspec

from shared.messages import EngineCoreOutput, EngineCoreRequest


class StreamLedger:
    def __init__(self) -> None:
        # request id -> (the request as first submitted, the tokens received since)
        self._open: dict[str, tuple[EngineCoreRequest, list[int]]] = {}

    def __len__(self) -> int:
        return len(self._open)

    def submitted(self, request: EngineCoreRequest) -> None:
        self._open[request.request_id] = (request, list(request.output_token_ids))

    def received(self, output: EngineCoreOutput) -> None:
        entry = self._open.get(output.request_id)
        if entry is None:
            return
        entry[1].extend(output.new_token_ids)
        if output.finish_reason is not None:
            del self._open[output.request_id]

    def forget(self, request_ids: list[str]) -> None:
        """Closed, finished or aborted here (a stop string): never to be resumed."""
        for request_id in request_ids:
            self._open.pop(request_id, None)

    def resumed_requests(self) -> list[EngineCoreRequest]:
        return [
            msgspec.structs.replace(request, output_token_ids=list(tokens))
            for request, tokens in self._open.values()
        ]
