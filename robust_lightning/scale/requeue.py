"""A SLURM job's restart: SLURM requeues a job (pre-emption, a node failure, ``scontrol requeue``) and runs its batch
script again, under the same job id and with ``SLURM_RESTART_COUNT`` one higher. So a fit restarted by SLURM is the
same command in the same run directory (slurm/train_multinode.sbatch, a sweep's cell).

Given no ``ckpt_path``, Lightning resumes such a fit by itself from the ``hpc_ckpt_N.ckpt`` numbered highest in
``trainer.default_root_dir``, which its requeue signal handler writes (``--signal=SIGUSR1@90``), even where a later
attempt went further and stopped without that signal (pre-emption, ``scancel``: SLURM ends it with SIGTERM, and the
fit writes last.ckpt of the step it stops at). With no hpc checkpoint it would train the run again from its start. A
restarted fit without ``ckpt_path`` therefore goes on as ``--ckpt_path last``, as a torchrun restart does
(scale/torchrun.py): in its own run directory, from the checkpoint furthest in training, hpc or not, with one log. So
does any fit without ``ckpt_path`` that Lightning would resume from an hpc checkpoint by itself, such as a new job
given an earlier job's run directory.
"""

import os

from jsonargparse import Namespace
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info

from robust_lightning.training.run_directory import hpc_checkpoints


def restart_count() -> int | None:
    """How many times SLURM has requeued this job; None outside a SLURM job (or one that does not say)."""
    count = os.environ.get("SLURM_RESTART_COUNT")
    return int(count) if count is not None and count.isdigit() else None


def continue_slurm_restart(subcommand: str, config: Namespace) -> bool:
    """A fit without ckpt_path that SLURM restarted, or that Lightning would resume from an hpc checkpoint by itself,
    goes on as ``--ckpt_path last`` (``config.ckpt_path``), whose choice of checkpoint is by training step
    (robust_lightning.training.run_directory.resume_checkpoint). Returns whether it does."""
    if subcommand != "fit" or config.get("ckpt_path"):
        return False
    restarts = restart_count()
    root = config.trainer.get("default_root_dir")
    if restarts:
        why = f"SLURM restarted this job ({restarts} restarts so far)"
    elif hpc_checkpoints(root):
        why = f"{root or os.getcwd()} holds SLURM's hpc checkpoints, which Lightning would resume from by itself"
    else:
        return False
    rank_zero_info(f"{why}: the fit goes on as --ckpt_path last")
    config.ckpt_path = "last"
    return True


def slurm_restart_note() -> str:
    """What a user told how to resume a stopped command must also know inside a SLURM job: SLURM may restart the
    job itself (a pre-empted job submitted with ``--requeue``), and the restart resumes by itself
    (``continue_slurm_restart``, an evaluation's outcomes). Empty outside SLURM."""
    if not SLURMEnvironment.detect():
        return ""
    return (
        "\n(if SLURM requeues this job, as it does a pre-empted job submitted with --requeue, the restart resumes by "
        "itself: a resume of your own would start a second copy)"
    )
