"""torch's elastic restart with gloo, without this project: a minimal reproduction of the failure that
robust_lightning/scale/torchrun.py works around.

    torchrun --standalone --nproc_per_node 2 --max-restarts 1 tests/torchrun_restart.py            # fails often
    torchrun --standalone --nproc_per_node 2 --max-restarts 1 tests/torchrun_restart.py --prefix   # does not

Rank 0 of the first attempt kills itself (as ``kill -9`` would) after a few all-reduces; torchrun's agent restarts
both workers. In the restarted attempt, set up the plain way (``init_process_group("gloo")``), a worker can read the
address that a worker of the failed attempt published in the agent's store, which outlives the attempts, and gloo
fails: "Gloo connectFullMesh failed ... Connection refused". With torch 2.14.1 on a 2-core machine, 2 of 6 runs
failed so and a third waited until it was killed. With ``--prefix`` each attempt's keys are under a prefix of their
own, and all 11 restarts tried so succeeded.
"""

import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if "--prefix" in sys.argv:
    world_size = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, False, timedelta(seconds=60)
    )
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"attempt_{attempt}", store), rank=int(os.environ["RANK"]), world_size=world_size
    )
else:
    dist.init_process_group("gloo")
rank = dist.get_rank()
print(f"attempt {attempt}, rank {rank}: process group set up", flush=True)
for step in range(20):
    total = torch.ones(1)
    dist.all_reduce(total)
    if attempt == 0 and rank == 0 and step == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
print(f"attempt {attempt}, rank {rank}: done", flush=True)
dist.destroy_process_group()
