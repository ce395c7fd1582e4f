"""Data-parallel training under torchrun: each rank takes every world_size-th slide, and after each accumulation
window the gradients are averaged with all_reduce over flat buckets of ``distributed.bucket_mb`` (gradient grouping
as in the exascale paper: few large messages instead of one per parameter).

We do not wrap the model in DDP: its hooks fire per parameter during backward, which the SFT engine's custom autograd
(tiles accumulate into the same .grad many times) would reduce too early; one explicit reduction per optimizer step
is exact and simple.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from wsitrain.config import COLLECTIVE_TIMEOUT_MINUTES


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(
    backend: str | None = "auto", device_type: str = "cpu", timeout_minutes: float = COLLECTIVE_TIMEOUT_MINUTES
) -> DistInfo:
    """Join the process group torchrun describes through WORLD_SIZE/RANK/LOCAL_RANK; single process otherwise.

    ``timeout_minutes`` (distributed.collective_timeout_minutes) bounds how long a collective waits for a rank.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)  # one GPU per process; NCCL uses the current device
    if not dist.is_initialized():
        if backend in (None, "auto"):
            backend = "nccl" if device_type == "cuda" else "gloo"
        timeout = timedelta(minutes=timeout_minutes)
        dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)
    return DistInfo(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank)


def padded_order(order: Sequence[int], world_size: int) -> list[int]:
    """``order`` wrapped around to a multiple of ``world_size``: every rank runs the same number of steps
    (collectives would hang otherwise); the first few slides appear twice when the count does not divide."""
    if not order:
        return []
    per_rank = -(-len(order) // world_size)
    return [order[i % len(order)] for i in range(per_rank * world_size)]


def shard(order: list[int], info: DistInfo) -> list[int]:
    """This rank's slides under ``distributed.balance: round_robin``: every world_size-th of the padded ``order``."""
    if not info.enabled or not order:
        return list(order)
    return padded_order(order, info.world_size)[info.rank :: info.world_size]


def allreduce_gradients(params: list[torch.nn.Parameter], info: DistInfo, bucket_mb: float = 25.0) -> int:
    """Average .grad over ranks in flat buckets; returns the number of all_reduce calls made."""
    if not info.enabled:
        return 0
    # A rank whose slide gave no gradient to some parameter still has to take part: use zeros.
    for p in params:
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params if p.requires_grad]
    limit = max(1, int(bucket_mb * 1024 * 1024))
    calls, bucket, size = 0, [], 0
    for g in grads:
        bucket.append(g)
        size += g.numel() * g.element_size()
        if size >= limit:
            _reduce_bucket(bucket, info.world_size)
            calls, bucket, size = calls + 1, [], 0
    if bucket:
        _reduce_bucket(bucket, info.world_size)
        calls += 1
    return calls


def _reduce_bucket(bucket: list[torch.Tensor], world_size: int) -> None:
    flat = torch.cat([g.reshape(-1) for g in bucket])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat /= world_size
    offset = 0
    for g in bucket:
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n


def gather_objects(obj: Any, info: DistInfo) -> list[Any]:
    """Every rank's ``obj`` (e.g. validation predictions), in rank order; [obj] when not distributed."""
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    """Rank 0's ``obj`` on every rank (e.g. the run folder name)."""
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_ok(ok: bool, info: DistInfo) -> bool:
    """True when every rank says ``ok``: one all_reduce (MIN), so a rank whose start failed stops the others before
    they write anything (a rank that just exits leaves the others a "Connection closed by peer" instead)."""
    if not info.enabled:
        return ok
    flag = torch.tensor([1.0 if ok else 0.0])
    if dist.get_backend() == "nccl":
        flag = flag.cuda()
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item() > 0)


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def cleanup(info: DistInfo) -> None:
    if info.enabled and dist.is_initialized():
        dist.destroy_process_group()
