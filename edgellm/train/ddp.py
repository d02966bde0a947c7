"""Data-parallel plumbing: the process group (gloo on CPU) that `torchrun` sets up through the environment.

One process without torchrun is world 1 and every helper here is then a no-op, so the loop has one path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Dist:
    rank: int
    world: int
    local_world: int  # processes on this machine: they share its cores

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup() -> Dist:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR...), once per process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    if not dist.is_initialized():
        return Dist(0, 1, 1)
    return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_WORLD_SIZE", world)))


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier(d: Dist) -> None:
    if d.world > 1:
        dist.barrier()


def all_sum(d: Dist, values: list[float]) -> list[float]:
    """Element-wise sum over ranks (float64, so a handful of ranks sum exactly enough for reporting)."""
    if d.world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t)
    return t.tolist()


def any_rank(d: Dist, flag: bool) -> bool:
    """True on every rank if it is True on any: ranks stop on the same step (rank 0's clock decides)."""
    return all_sum(d, [float(flag)])[0] > 0 if d.world > 1 else flag


def gather(d: Dist, obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (on every rank)."""
    if d.world == 1:
        return [obj]
    out: list[Any] = [None] * d.world
    dist.all_gather_object(out, obj)
    return out


def broadcast(d: Dist, obj: Any) -> Any:
    """Rank 0's `obj` on every rank."""
    if d.world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
