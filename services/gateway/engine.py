"""The engine as the gateway's HTTP side sees it: what a request needs of the bus client
(shell/engine_client.py is the one that talks NATS), so no route or answer knows the
transport."""

from __future__ import annotations

from typing import Protocol

from services.gateway.output_queue import OutputQueue
from shared.messages import EngineCoreRequest, SchedulerInfo, TokenizeRequest


class Engine(Protocol):
    async def tokenize(self, request: TokenizeRequest, headers: dict[str, str] | None = None, attempts: int = 3,
                       timeout_s: float | None = None) -> list[int]: ...

    async def scheduler_info(self, max_age_s: float = 2.0) -> SchedulerInfo: ...

    def scheduler_silent(self) -> bool: ...

    def open(self, request_ids: list[str], queue: OutputQueue) -> None: ...

    def close(self, request_ids: list[str]) -> None: ...

    async def submit(self, request: EngineCoreRequest) -> None: ...

    def abort_soon(self, request_ids: list[str]) -> None: ...
