"""`checkpointing.on_every_rank`: under ZeRO-3 the "auto" decision is one for all ranks (a rank that
recomputes a layer in its backward gathers that layer's weights collectively, so a rank that did not
checkpoint would leave it waiting); elsewhere each rank keeps its own decision and makes no collective.

Two gloo processes on CPU. ZeRO-3's partitioned parameters are recognised by the `ds_id` DeepSpeed sets on
them; here it is set by hand on a plain module, the one thing the function reads of a partitioned model."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from rl.jobs.server import free_port
from rl.trainer.checkpointing import on_every_rank


def _rank(rank: int, port: int, partitioned: bool, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        model = nn.Linear(2, 2)
        if partitioned:
            for p in model.parameters():
                p.ds_id = 0
        wants = rank == 0  # rank 0 holds the long micro-batch: only its estimate passes the threshold
        got = on_every_rank(model, wants)
        if not partitioned:  # no collective was made: a barrier still pairs up with the other rank's
            dist.barrier()
        out.put((rank, got))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("partitioned", [True, False])
def test_auto_checkpointing_is_one_decision_under_zero3_only(partitioned):
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, partitioned, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got == ({0: True, 1: True} if partitioned else {0: True, 1: False})


def test_one_process_keeps_its_decision():
    assert on_every_rank(nn.Linear(2, 2), True) is True and on_every_rank(nn.Linear(2, 2), False) is False
