"""This process: its place in a `torchrun` job, its device's name and its peak memory."""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass

import torch

from mplab.hardware import describe, resolve_device

__all__ = ["Processes", "device_name", "reset_peak_memory", "peak_memory"]


@dataclass
class Processes:
    """This process's place in a `torchrun` job (rank 0 of 1 when run alone)."""

    rank: int
    world_size: int
    device: torch.device
    started_group: bool = False  # we called init_process_group, so we destroy it

    @property
    def main(self) -> bool:
        return self.rank == 0

    @classmethod
    def start(cls, device: str, group: bool = False) -> Processes:
        """Read torchrun's RANK / WORLD_SIZE / LOCAL_RANK and join the process group: gloo on a
        CPU, NCCL on GPUs (one GPU per process, cuda:LOCAL_RANK). Alone, a process joins a
        group of one only with `group` (FSDP2 shards over a group even of one)."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        dev = resolve_device(device)
        if world == 1 and not group:
            return cls(0, 1, dev)
        import torch.distributed as dist

        if world == 1 and not dist.is_initialized():  # no torchrun: a store in this process
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo",
                                    store=dist.HashStore(), rank=0, world_size=1)
            return cls(0, 1, dev, started_group=True)

        if dev.type == "cuda":
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(dev)
        started = not dist.is_initialized()
        if started:
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        return cls(dist.get_rank(), dist.get_world_size(), dev, started)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a scalar over all processes (itself when alone)."""
        if self.world_size == 1:
            return value
        import torch.distributed as dist

        value = value.clone()
        dist.all_reduce(value)
        return value / self.world_size

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.started_group:
            import torch.distributed as dist

            dist.destroy_process_group()


def device_name(device: torch.device) -> str:
    return describe(device.type).partition(": ")[2]


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> tuple[int, str]:
    """(bytes, what they measure): GPU tensors since the reset, or the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "cuda max_memory_allocated"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024), "process peak RSS"
