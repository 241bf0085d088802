"""Training launched by torchrun (torch.distributed.run): multi-node without SLURM, and its elastic restarts.

With ``--max-restarts N``, torchrun's agent restarts every worker of a node when one of them fails (a crash, a
``kill -9``). The restarted workers run the same command again; here a fit then continues the same run from its
newest checkpoint, as ``--ckpt_path last`` does (``restart_count``).

The workers of every attempt meet in the agent's key-value store (``TORCHELASTIC_USE_AGENT_STORE``), which outlives
the attempts. torch 2.14's rendezvous uses it without a per-attempt prefix (torch/distributed/rendezvous.py,
``_create_c10d_store``: "We create a new TCPStore for every retry so no need to add prefix for each attempt"), but
the agent keeps one store: a restarted worker can then read the address a worker of the failed attempt published,
and gloo's connection to it is refused ("Gloo connectFullMesh failed ... Connection refused"), or the attempt waits
for ever (3 restarts of 6 failed so here). ``tests/torchrun_restart.py`` reproduces it without this project.
``join_process_group`` sets the process group up before Lightning does, with the keys of each attempt under a
prefix of their own.
"""

import atexit
import os
from datetime import timedelta

import torch.distributed as dist


def restart_count() -> int | None:
    """How many times torchrun's agent has restarted this worker's group; None when torchrun did not start it."""
    count = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return int(count) if count is not None and count.isdigit() else None


def join_process_group(backend: str, timeout: timedelta = timedelta(minutes=30)) -> bool:
    """Under torchrun, set up the default process group with the keys of this attempt under a prefix of their own
    (see the module docstring); Lightning then finds it set up and uses it. Returns whether it did (not under
    torchrun, or already set up: nothing to do)."""
    attempt = restart_count()
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return False
    world_size = int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, False, timeout)
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"robust-lightning/attempt_{attempt}", store),
        rank=int(os.environ["RANK"]),
        world_size=world_size,
        timeout=timeout,
    )
    atexit.register(_leave_process_group)  # Lightning leaves a gloo group be at exit, where its threads can abort
    return True


def _leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
