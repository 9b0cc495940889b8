"""A two-node check run by tests/test_slurm_torchrun.py: one gloo all_reduce of rank + 1.

Started by torchrun (the environment gives rank and world size); every rank writes what it saw to
``$ALLREDUCE_OUT/rank-<rank>.json``.
"""

import json
import os
import socket
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
value = torch.tensor([float(rank + 1)])
dist.all_reduce(value)  # sum over ranks: 1 + 2 = 3 when both contributed
gathered = [torch.zeros(1) for _ in range(world)]
dist.all_gather(gathered, torch.tensor([float(rank)]))
out = os.path.join(os.environ["ALLREDUCE_OUT"], f"rank-{rank}.json")
with open(out + ".tmp", "w") as f:
    json.dump(
        {
            "rank": rank,
            "world_size": world,
            "sum": value.item(),
            "ranks_seen": [int(t.item()) for t in gathered],
            "node": os.environ.get("SLURMD_NODENAME"),
            "master_addr": os.environ.get("MASTER_ADDR"),
            "host": socket.gethostname(),
        },
        f,
    )
os.replace(out + ".tmp", out)
print(f"rank {rank}/{world} on {os.environ.get('SLURMD_NODENAME')}: all_reduce sum {value.item()}", flush=True)
dist.destroy_process_group()
sys.exit(0)
