"""A SLURM job's restart: SLURM requeues a job (pre-emption, a node failure, ``scontrol requeue``) and runs its batch
script again, under the same job id and with ``SLURM_RESTART_COUNT`` one higher. So a fit restarted by SLURM is the
same command in the same run directory (slurm/train_multinode.sbatch, a sweep's cell).

Lightning resumes such a fit by itself only from an ``hpc_ckpt_N.ckpt`` in ``trainer.default_root_dir``, which its
requeue signal handler writes (``--signal=SIGUSR1@90``). A job requeued without that signal, pre-empted for instance
(SLURM ends it with SIGTERM, and the fit writes last.ckpt of the step it stops at), has none: the restart would train
the run again from its start. A restarted fit without ``ckpt_path`` then goes on as ``--ckpt_path last``, as a torchrun
restart does (scale/torchrun.py): in its own run directory, from its newest checkpoint, with one log.
"""

import logging
import os
from pathlib import Path

from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.utilities import rank_zero_info

from robust_lightning.training.run_directory import fit_checkpoint_directory, newest_intact_checkpoint

log = logging.getLogger(__name__)

HPC_CHECKPOINT = "hpc_ckpt_"  # what Lightning looks for in a file's name (_CheckpointConnector._hpc_resume_path)


def restart_count() -> int | None:
    """How many times SLURM has requeued this job; None outside a SLURM job (or one that does not say)."""
    count = os.environ.get("SLURM_RESTART_COUNT")
    return int(count) if count is not None and count.isdigit() else None


def hpc_checkpoints(default_root_dir: str | None) -> list[Path]:
    """The hpc checkpoints Lightning, given no ckpt_path, resumes a fit from by itself (the newest): under srun (its
    SLURM environment detected), the files named ``*hpc_ckpt_*`` in ``trainer.default_root_dir`` (the working
    directory when unset). The same condition as Lightning 2.6's ``_CheckpointConnector._parse_ckpt_path``, for a
    local folder (a remote one, ``s3://...``, is taken to hold none: the fit then resumes from its newest
    checkpoint)."""
    root = str(default_root_dir or os.getcwd())
    if not SLURMEnvironment.detect() or "://" in root or not Path(root).is_dir():
        return []
    return [entry for entry in Path(root).iterdir() if HPC_CHECKPOINT in entry.name]


def checkpoint_saved_after(hpc: list[Path], run_dir: Path) -> Path | None:
    """The checkpoint a restart should resume from instead of the hpc ones, where the run went further after the
    last requeue: a later attempt stopped without the requeue signal (pre-emption: last.ckpt of its stop step) or
    killed after a step checkpoint. The newest intact checkpoint of the fit whose run directory is ``run_dir``
    (slurm/train_multinode.sbatch: RUN_DIR, also default_root_dir), where it was written after every hpc one."""
    checkpoints = fit_checkpoint_directory(run_dir)
    newest, _ = newest_intact_checkpoint(checkpoints) if checkpoints is not None else (None, [])
    if newest is None or newest.stat().st_mtime <= max(path.stat().st_mtime for path in hpc):
        return None
    return newest


def continue_slurm_restart(subcommand: str, config) -> bool:
    """A fit that SLURM restarted, given no ckpt_path, goes on as ``--ckpt_path last`` where Lightning has no hpc
    checkpoint to resume from, and from its newer checkpoint where the run went further after the requeue that wrote
    the hpc one (``config.ckpt_path``). Returns whether it does."""
    restarts = restart_count()
    if subcommand != "fit" or config.get("ckpt_path") or not restarts:
        return False
    root = config.trainer.get("default_root_dir")
    hpc = hpc_checkpoints(root)
    if hpc:
        newer = checkpoint_saved_after(hpc, Path(root or os.getcwd()))
        if newer is None:
            return False  # Lightning resumes from the newest hpc checkpoint
        rank_zero_info(
            f"SLURM restarted this job ({restarts} restarts so far): {newer} was saved after the hpc checkpoint of "
            "its last requeue, so the fit goes on from it"
        )
        config.ckpt_path = str(newer)
        return True
    rank_zero_info(
        f"SLURM restarted this job ({restarts} restarts so far) and left no hpc checkpoint: the fit goes on as "
        "--ckpt_path last"
    )
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
