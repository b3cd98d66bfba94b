"""A worker of N ranks: rank 0 is the worker everyone sees (the bus's, or the offline
LLM's); ranks 1..N-1 are processes it starts (`python -m services.worker.parallel.ranks`),
each building the same runner on its slice of the model. Rank 0 hands every step to the
others before running it itself (SchedulerOutput's msgpack bytes, broadcast on the host
group); every rank then runs it, the layers' all-reduces keeping them in step, and every
rank samples the same tokens, which rank 0 alone answers with.

A rank that dies takes the group down as one worker: rank 0 exits when a follower does
(the supervisor restarts the worker and its requests move, as on any worker's death); a
follower's collective fails when rank 0 is gone, and it exits."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import secrets
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from services.worker.executor import launch_step
from services.worker.model_runner import ModelRunner
from services.worker.models.decoder_config import ModelConfig
from services.worker.parallel.group import TensorParallelGroup
from services.worker.parallel.sharding import local_config
from shared.config import WorkerConfig
from shared.logs import setup_logging
from shared.messages import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger("llmbus.worker")

_ENCODER = msgspec.msgpack.Encoder()


def build_runner(model_path: str, config: WorkerConfig, threads: int | None = None):
    """The worker's runner: a ModelRunner, or with --tensor-parallel-size N rank 0's, whose
    steps every rank runs (call on the runner's thread: executor.py says why)."""
    size = config.tensor_parallel_size
    if size < 1:
        raise ValueError(f"--tensor-parallel-size must be at least 1, got {size}")
    if size == 1:
        return ModelRunner(model_path, config)
    # (what cannot be sharded: refused before any rank starts)
    local_config(ModelConfig.from_folder(model_path), size, 0 if config.enable_expert_parallel else None)
    # Every rank draws the same tokens: one seed for all, drawn here where none is given.
    config = dataclasses.replace(config, seed=secrets.randbits(31) if config.seed is None else config.seed)
    cuda = config.device in (None, "cuda") and torch.cuda.is_available() or str(config.device).startswith("cuda")
    if cuda and torch.cuda.device_count() < size:
        raise ValueError(f"--tensor-parallel-size {size}: this host has {torch.cuda.device_count()} GPU(s)")
    # (CPU ranks share the host's cores: each gets its share, unless --threads says)
    threads = threads or max(1, (os.cpu_count() or 1) // size)
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, timeout=timedelta(seconds=120),
                          wait_for_workers=False)
    followers = [_start_follower(rank, size, store.port, model_path, _rank_config(config, rank, cuda), threads)
                 for rank in range(1, size)]
    watcher = _Watcher(followers)
    try:
        torch.set_num_threads(threads)
        rank0 = _rank_config(config, 0, cuda)
        group = TensorParallelGroup(0, size, _device(rank0), store).make_current()
        runner = ModelRunner(model_path, rank0)
    except BaseException:
        watcher.stop()
        raise
    log.info("tensor parallel: %d ranks", size, extra={"tensor_parallel_size": size})
    return TensorParallelRunner(runner, group, watcher)


def _rank_config(config: WorkerConfig, rank: int, cuda: bool) -> WorkerConfig:
    """Rank `rank`'s: its device, and its own file of the host's KV tier (a slot of it holds
    this rank's heads of a block; every rank gets the same orders, so one index serves all:
    the tier is named by rank 0's file)."""
    cache = config.cache_config
    if rank and cache.kv_offloading_path:
        config = dataclasses.replace(config, cache_config=dataclasses.replace(
            cache, kv_offloading_path=f"{cache.kv_offloading_path}-tp{rank}"))
    return dataclasses.replace(config, device=f"cuda:{rank}") if cuda else config


def _device(config: WorkerConfig) -> torch.device:
    return torch.device(config.device or "cpu")


def _start_follower(rank: int, size: int, port: int, model_path: str, config: WorkerConfig,
                    threads: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "services.worker.parallel.ranks"], stdin=subprocess.PIPE)
    proc.stdin.write(pickle.dumps((rank, size, port, model_path, config, threads)))
    proc.stdin.close()
    return proc


class _Watcher:
    """Rank 0's watch on its followers: one that exits takes this process with it."""

    def __init__(self, followers: list[subprocess.Popen]) -> None:
        self.followers = followers
        self.stopping = False
        for rank, proc in enumerate(followers, 1):
            threading.Thread(target=self._watch, args=(rank, proc), daemon=True, name=f"tp-rank-{rank}").start()

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self.stopping:
            self._die(rank, code)

    def _die(self, rank: int, code) -> None:
        log.error("tensor-parallel rank %d exited (code %s): the worker goes down with it", rank, code)
        logging.shutdown()
        os._exit(1)

    @contextlib.contextmanager
    def guard(self, wait_s: float = 5.0):
        """A step that fails because a rank died (its collective's peer is gone) takes the
        worker down before it can answer: its requests move to another worker, as from any
        worker's death, rather than end with the collective's error. Another failure is the
        step's own."""
        try:
            yield
        except BaseException:
            deadline = time.monotonic() + wait_s
            while not self.stopping and time.monotonic() < deadline:
                dead = next(((rank, p.returncode) for rank, p in enumerate(self.followers, 1)
                             if p.poll() is not None), None)
                if dead is not None:
                    self._die(*dead)
                time.sleep(0.05)
            raise

    def stop(self, timeout_s: float = 30.0) -> None:
        self.stopping = True
        for proc in self.followers:
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()


class TensorParallelRunner:
    """Rank 0's runner: every step goes to the other ranks, then runs here. Anything else
    (its description, its grammars, its sizes) is the ModelRunner's own."""

    def __init__(self, runner: ModelRunner, group: TensorParallelGroup, watcher: _Watcher) -> None:
        self.runner, self.group, self._watcher = runner, group, watcher

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def launch(self, step: SchedulerOutput):
        with self._watcher.guard():
            self.group.send_step(_ENCODER.encode(step))
            return _Guarded(self.runner.launch(step), self._watcher)

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        return self.launch(step).finish()

    def close(self) -> None:
        """The followers stopped (an empty step), then the group."""
        self._watcher.stopping = True
        self.group.send_step(b"")
        self._watcher.stop()
        self.group.close()


class _Guarded:
    """A launched step whose landing (on a GPU, where a collective's failure shows) is
    watched as its launch is."""

    __slots__ = ("launched", "watcher")

    def __init__(self, launched, watcher: _Watcher) -> None:
        self.launched, self.watcher = launched, watcher

    def __getattr__(self, name: str):
        return getattr(self.launched, name)

    def wait(self) -> None:
        with self.watcher.guard():
            self.launched.wait()

    def finish(self) -> ModelRunnerOutput:
        with self.watcher.guard():
            return self.launched.finish()


def follow(rank: int, size: int, port: int, model_path: str, config: WorkerConfig, threads: int) -> None:
    """A follower rank: join, build the runner, run every step rank 0 hands over."""
    torch.set_num_threads(threads)
    group = TensorParallelGroup.meet(rank, size, _device(config), port).make_current()
    runner = ModelRunner(model_path, config)
    decoder = msgspec.msgpack.Decoder(SchedulerOutput)
    try:
        while data := group.recv_step():
            # (a failure: logged and its requests dropped, as rank 0 does with the same step)
            launch_step(runner, decoder.decode(data)).finish()
    except RuntimeError as exc:  # (gloo's "Connection closed by peer": rank 0 is gone, and so is the worker)
        log.warning("tensor-parallel rank %d stops: rank 0 is gone (%s)", rank, type(exc).__name__)
        os._exit(0)
    group.close()


def _die_with_parent() -> None:
    """Linux: this process is killed when rank 0's is (however it ends: a SIGKILL included,
    even while this rank loads its weights, before any collective could notice)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    _die_with_parent()
    # Rank 0 stops the group (a terminal's Ctrl-C reaches every process of its group: rank
    # 0's drain would lose its ranks under it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    arguments = pickle.loads(sys.stdin.buffer.read())
    setup_logging(os.environ.get("LLMBUS_VERBOSE") == "1")  # (the services' JSON lines, each naming its rank)
    logging.getLogger().handlers[0].addFilter(
        lambda record: setattr(record, "tensor_parallel_rank", arguments[0]) or True)
    follow(*arguments)
