"""The run's processes: ``Dist`` (rank, world size, device), ``setup_distributed`` (torchrun's environment: NCCL on
GPUs, gloo on the CPU) and the two collectives the optimizer uses, asynchronous, with gloo's stand-ins for the
``*_tensor`` collectives it lacks (the CPU runs of the tests: tests/test_world_sizes.py). Under torchrun a rank
ends when torchrun ends (``end_with_the_launcher``)."""
import ctypes
import os
import signal
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def gloo(self):
        return self.world > 1 and dist.get_backend() == "gloo"


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_the_parent():
    """On Linux: this process gets SIGTERM when its parent ends; a parent already gone (parent pid 1) ends it at
    once. Returns whether the signal was set (not on other systems)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
        return False
    if os.getppid() == 1:  # the parent ended before the prctl: no signal would come
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def end_with_the_launcher():
    """Under torchrun (TORCHELASTIC_RUN_ID set), on Linux: this process gets SIGTERM when its parent, torchrun's
    agent, ends (end_with_the_parent). torchrun starts each rank in a process session of its own, so without this
    a rank outlives a torchrun that was killed (SIGKILL, a time limit's kill, a closed job) and keeps its GPU busy,
    unseen. Returns whether the signal was set."""
    return "TORCHELASTIC_RUN_ID" in os.environ and end_with_the_parent()


def setup_distributed():
    end_with_the_launcher()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1:
        if device.type == "cuda":
            dist.init_process_group(backend="nccl", device_id=device)
        else:
            dist.init_process_group(backend="gloo")
        # gloo lets a rank leave init_process_group while a peer is still connecting to it; a rank that then fails
        # at once (a missing file) would break the peer's connection and bury our one-line error under gloo's.
        # No rank leaves the barrier before every rank has left init_process_group.
        dist.barrier()
    return Dist(rank, world, device)


def reduce_scatter_sum(d, full):
    """Async sum of `full` (rows padded to a multiple of the world) over ranks; returns (work, my row shard)."""
    rows = full.shape[0] // d.world
    if d.world == 1:
        return None, full
    if d.gloo:  # gloo has no reduce_scatter_tensor: all-reduce the whole buffer and keep my rows
        work = dist.all_reduce(full, op=dist.ReduceOp.SUM, async_op=True)
        return work, full[d.rank * rows:(d.rank + 1) * rows]
    shard = torch.empty((rows, *full.shape[1:]), dtype=full.dtype, device=full.device)
    return dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.SUM, async_op=True), shard


def all_gather_rows(d, shard, out):
    """Async gather of every rank's row shard into `out` (rows = world * shard rows); returns work or None."""
    if d.world == 1:
        out.copy_(shard)  # returns at once when shard is out's own memory (Group.in_place)
        return None
    if d.gloo:
        parts = list(out.chunk(d.world))
        work = dist.all_gather(parts, shard.contiguous(), async_op=True)
        return work
    return dist.all_gather_into_tensor(out, shard.contiguous(), async_op=True)
