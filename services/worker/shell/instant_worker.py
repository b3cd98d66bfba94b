"""`llmbus bench control-plane`'s worker: InstantRunner (services/worker/instant_runner.py)
on the bus, joined to a scheduler shard as a real worker joins (announced, heartbeating),
answering each step as it arrives, or `step_time_s` after (a device's step time, so steps
fill as a real worker's do). Not a serving worker: it has no model."""

from __future__ import annotations

import asyncio
import uuid

import msgspec

from services.worker.instant_runner import InstantRunner
from shared.bus import Subjects, close_for_exit, connect, encode, stop_on_signals
from shared.messages import SchedulerOutput, WorkerInfo


async def serve(nats_url: str, model_name: str, data_parallel_rank: int = 0, num_kv_blocks: int = 65536,
                block_size: int = 16, max_model_len: int = 4096, vocab_size: int = 384,
                eos_token_id: int | None = None, step_time_s: float = 0.0) -> None:
    worker_id = "instant-" + uuid.uuid4().hex[:8]
    runner = InstantRunner(vocab_size, eos_token_id)
    info = WorkerInfo(worker_id, model_name, num_kv_blocks, block_size, max_model_len, vocab_size, eos_token_id,
                      incarnation=uuid.uuid4().int & (2**48 - 1), data_parallel_rank=data_parallel_rank)
    subjects = Subjects(model_name)
    nc = await connect(nats_url, f"worker-{worker_id}")
    decoder = msgspec.msgpack.Decoder(SchedulerOutput)

    async def on_step(msg) -> None:  # (a subscription's messages are handled one at a time)
        output = runner.execute(decoder.decode(msg.data))
        if step_time_s:
            await asyncio.sleep(step_time_s)
        await msg.respond(encode(output))

    async def announce(_msg=None) -> None:
        await nc.publish(subjects.announce, encode(info))

    await nc.subscribe(subjects.step(worker_id), cb=on_step)
    await nc.subscribe(subjects.scheduler_hello, cb=announce)
    stop = stop_on_signals()
    while not stop.is_set():
        await announce()
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except asyncio.TimeoutError:
            pass
    info.draining = True
    await announce()
    await close_for_exit(nc)


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--served-model-name", required=True)
    parser.add_argument("--data-parallel-rank", type=int, default=0)
    parser.add_argument("--vocab-size", type=int, default=384)
    parser.add_argument("--eos-token-id", type=int, default=None)
    parser.add_argument("--step-time-ms", type=float, default=0.0)
    args = parser.parse_args()
    asyncio.run(serve(args.nats_url, args.served_model_name, args.data_parallel_rank, vocab_size=args.vocab_size,
                      eos_token_id=args.eos_token_id, step_time_s=args.step_time_ms / 1000))
