"""One worker's tensor-parallel group on torch.distributed.

The ranks meet at rank 0's TCPStore (a port the kernel picks: nothing to agree on
beforehand), then form two groups, as vLLM does: the device's (NCCL on CUDA, gloo on CPU)
for the layers' sums, and a gloo group on the host for the steps rank 0 hands the others
(bytes that never touch the device)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

# A follower waits for its next step inside a collective for as long as the worker idles:
# no timeout that an idle night could reach. (Meeting has its own, short: `meet_timeout_s`.)
_IDLE_FOREVER = timedelta(days=3650)

_current: TensorParallelGroup | None = None


def current_group() -> TensorParallelGroup | None:
    """The group this process's model runner is a rank of; None outside one (size 1)."""
    return _current


class TensorParallelGroup:
    def __init__(self, rank: int, world_size: int, device: torch.device, store: dist.Store) -> None:
        self.rank, self.world_size = rank, world_size
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=_IDLE_FOREVER)
        self.steps = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=_IDLE_FOREVER)

    @classmethod
    def meet(cls, rank: int, world_size: int, device: torch.device, port: int,
             meet_timeout_s: float = 120.0) -> TensorParallelGroup:
        """A follower's way in: rank 0's store on this host at `port`. A rank that cannot
        reach it in time is an error naming it."""
        try:
            store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False,
                                  timeout=timedelta(seconds=meet_timeout_s))
        except Exception as exc:  # (torch's own: DistStoreError, RuntimeError)
            why = str(exc).split("[", 1)[0].strip() or type(exc).__name__  # (torch appends its C++ log: cut)
            raise RuntimeError(f"tensor-parallel rank {rank} of {world_size} could not reach rank 0's store at "
                               f"127.0.0.1:{port} in {meet_timeout_s:.0f} s: {why}") from None
        return cls(rank, world_size, device, store)

    def make_current(self) -> TensorParallelGroup:
        global _current
        _current = self
        return self

    # ---- what the layers and the runner share ---------------------------------------

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The ranks' partial products summed, in place (every rank gets the same bits)."""
        dist.all_reduce(tensor)
        return tensor

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor) -> None:
        """Every rank's `tensor` into `parts`, by rank."""
        dist.all_gather(parts, tensor)

    def all_max(self, tensor: torch.Tensor) -> torch.Tensor:
        """The largest of every rank's values, element by element, in place (a quantized
        row-parallel product's channel scales: over the whole channel, not a rank's slice)."""
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor

    def min(self, value: int) -> int:
        """The least of every rank's `value` (KV blocks: every rank must hold the same ids)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.steps)
        return int(t.item())

    # ---- steps from rank 0 -------------------------------------------------------------

    def send_step(self, data: bytes) -> None:
        """Rank 0: a step's bytes to every other rank (empty: stop)."""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, 0, group=self.steps)
        if data:
            dist.broadcast(torch.frombuffer(bytearray(data), dtype=torch.uint8), 0, group=self.steps)

    def recv_step(self) -> bytes:
        """A follower: the next step's bytes from rank 0 (empty: stop)."""
        size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, 0, group=self.steps)
        if not size.item():
            return b""
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(data, 0, group=self.steps)
        return data.numpy().tobytes()

    def close(self) -> None:
        global _current
        if _current is self:
            _current = None
        if dist.is_initialized():
            dist.destroy_process_group()
