"""The worker service: the model runner behind the bus.

It announces itself (model, KV capacity, context) on start, whenever a scheduler says
hello, and every `heartbeat_s` after that; then it answers `SchedulerOutput` requests on
its step subject with a `ModelRunnerOutput`, in order (served_steps.py: on a GPU the next
step is launched before the one before it is answered). The forward pass runs on the
executor's one thread, so the event loop keeps heartbeats and NATS pings alive during a
long step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
import uuid

from services.worker.executor import InProcessExecutor
from services.worker.parallel.ranks import build_runner
from services.worker.shell.served_steps import ServedSteps
from shared.bus import BusAuth, Subjects, close_for_exit, connect, encode, stop_on_signals
from shared.config import WorkerConfig
from shared.kv_tier_files import tier_path
from shared.kv_transfer_tokens import DRAINED_TIER_SERVE_S, secret_from_env
from shared.tracing import setup_tracing, shutdown_tracing

log = logging.getLogger("llmbus.worker")


async def serve(
    model_path: str,
    nats_url: str,
    model_name: str,
    worker_config: WorkerConfig,
    worker_id: str | None = None,
    heartbeat_s: float = 0.5,
    drain_timeout_s: float = 10.0,
    threads: int | None = None,
    ready: asyncio.Event | None = None,
    auth: BusAuth | None = None,
    data_parallel_rank: int = 0,
) -> None:
    """`data_parallel_rank`: the scheduler shard this worker joins."""
    worker_id = worker_id or uuid.uuid4().hex[:8]
    tracer = setup_tracing("worker")
    # The runner lives on the executor's one thread, loading included (executor.py says why).
    if worker_config.cache_config.kv_offloading_size is not None:  # the host's tier: this shard's file
        # (LLMBUS_KV_TIER_PATH: another file, a tmpfs of the operator's, or a host of its own)
        worker_config.cache_config.kv_offloading_path = os.environ.get("LLMBUS_KV_TIER_PATH") or tier_path(
            nats_url, Subjects(model_name).prefix, data_parallel_rank)
    executor = InProcessExecutor(lambda: build_runner(model_path, worker_config, threads), threads)
    runner = executor.runner
    # A server's first constrained request should not build the grammar compiler, and no
    # step should run beside its building (it holds the GIL): built before the worker joins.
    try:
        await asyncio.wrap_future(runner.grammars.warm_up())
    except Exception as exc:  # noqa: BLE001 - unconstrained requests are served all the same
        log.warning("structured outputs will fail: the grammar compiler did not build (%s)", exc)
    subjects = Subjects(model_name)
    # The incarnation is random per process: one restarted under the same id (as `llmbus
    # serve` and compose restart it) is a new incarnation to the scheduler, however soon it is back.
    info = runner.describe(worker_id, model_name, incarnation=secrets.randbits(48))
    info.data_parallel_rank = data_parallel_rank
    secret = secret_from_env()
    # Its host tier's slots, to other hosts' workers (a tensor-parallel worker's rank 0
    # serves every rank's file, to workers of as many ranks)
    if runner.kv_tier is not None and secret is not None:
        info.kv_tier_address = await executor.run(runner.kv_tier.serve, secret, worker_config.kv_ip or "0.0.0.0",
                                                   worker_config.kv_ip or None, worker_config.kv_port)
    steps = ServedSteps(executor, tracer)

    async def on_reconnect() -> None:
        # A step or its answer may have been lost in the gap: say so at once, and the
        # scheduler takes this worker back afresh instead of waiting out a step deadline.
        info.incarnation += 1
        await announce()

    nc = await connect(nats_url, f"worker-{worker_id}", on_reconnect, auth)

    last_step_at = [time.monotonic()]

    async def handle_step(msg) -> None:
        last_step_at[0] = time.monotonic()
        steps.put(msg)

    async def announce(_msg=None) -> None:
        await nc.publish(subjects.announce, encode(info))

    answering = asyncio.create_task(steps.run())
    await nc.subscribe(subjects.step(worker_id), cb=handle_step)
    await nc.subscribe(subjects.scheduler_hello, cb=announce)
    await nc.flush()
    stop = stop_on_signals()
    log.info("worker %s ready: %d KV blocks of %d, joining shard %d", worker_id, runner.num_blocks, runner.block_size,
             data_parallel_rank)
    if ready is not None:
        ready.set()
    while not stop.is_set():
        if nc.is_connected:
            await announce()
        try:
            await asyncio.wait_for(stop.wait(), heartbeat_s)
        except asyncio.TimeoutError:
            pass
    # Drain: say we are leaving (the scheduler moves our requests elsewhere), finish the
    # step in hand, and go once steps have stopped coming.
    info.draining = True
    await announce()
    deadline = time.monotonic() + drain_timeout_s
    while time.monotonic() < deadline and time.monotonic() - last_step_at[0] < 1.0:
        await asyncio.sleep(0.1)
    if info.kv_tier_address:  # (the workers that took our requests load their KV from our tier a while yet)
        await asyncio.sleep(max(0.0, DRAINED_TIER_SERVE_S - (time.monotonic() - last_step_at[0])))
    answering.cancel()
    await asyncio.gather(answering, return_exceptions=True)
    await close_for_exit(nc)
    executor.close()
    shutdown_tracing()
