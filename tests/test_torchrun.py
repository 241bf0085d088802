"""Training launched by torchrun, as on a cluster without SLURM: an elastic restart (``--max-restarts``) after a worker
is killed with ``kill -9`` continues the same run from its newest checkpoint and ends with the weights of the same
fit left alone. Every torchrun here runs under a hard time limit that kills it and every worker."""

import csv
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch
from lightning import Callback

from helpers import REPO, tiny_config

KILLED_AT = 5  # rank 0 of the first attempt dies at the end of step 5; the newest checkpoint is that of step 4


class KillRankZero(Callback):
    """``kill -9`` of rank 0 in torchrun's first attempt, at the end of step ``step``."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
        if first_attempt and trainer.global_rank == 0 and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def torchrun(config: Path, timeout: float = 300) -> tuple[int, str]:
    """``torchrun --standalone --nproc_per_node 2 --max-restarts 1 -m robust_lightning fit --config CONFIG``."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += ["--max-restarts", "1", "-m", "robust_lightning", "fit", "--config", str(config)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        command,
        cwd=config.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        raise AssertionError(f"torchrun did not end within {timeout} s:\n{output[-4000:]}") from None
    return process.returncode, output


def config(tmp_path: Path, synthetic: Path, **extra) -> Path:
    """Two epochs of 4 steps on two ranks (global batch 8 of 32 images), a checkpoint every 2 steps."""
    tmp_path.mkdir()
    return tiny_config(
        tmp_path,
        synthetic,
        **{
            "trainer.devices": 2,
            "trainer.strategy": "ddp",
            "trainer.max_epochs": 2,
            "trainer.limit_train_batches": None,
            "trainer.limit_val_batches": 0,
            "trainer.log_every_n_steps": 1,
            "data.global_batch_size": 8,
            "data.num_workers": 1,
            "model.arch": "test_resnet",
            "model.attack": "apgd",
            "model.attack_steps": 1,
            "checkpoint.every_n_train_steps": 2,
            "checkpoint.monitor": None,
            **extra,
        },
    )


def test_an_elastic_restart_after_kill_9_continues_the_run_to_the_weights_of_the_fit_left_alone(tmp_path):
    synthetic = tmp_path / "synthetic"
    code, output = torchrun(config(tmp_path / "alone", synthetic))
    assert code == 0, output[-4000:]
    killed = {"trainer.callbacks": [{"class_path": "test_torchrun.KillRankZero", "init_args": {"step": KILLED_AT}}]}
    code, output = torchrun(config(tmp_path / "restarted", synthetic, **killed))
    assert code == 0, output[-4000:]
    assert "exitcode: -9" in output or "exitcode  : -9" in output  # the first attempt's rank 0 was killed
    assert "torchrun restarted this fit (1 restarts so far): it goes on as --ckpt_path last" in output
    run = tmp_path / "restarted" / "runs" / "tiny" / "version_0"
    assert "Restoring states from the checkpoint path at " + str(run / "checkpoints" / "last.ckpt") in output
    assert not (run.parent / "version_1").exists()  # the same run, in its own directory

    alone = tmp_path / "alone" / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    alone = torch.load(alone, weights_only=True)
    restarted = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    assert restarted["global_step"] == alone["global_step"] == 8
    for name, value in alone["state_dict"].items():
        assert torch.equal(restarted["state_dict"][name], value), name
    # one log of both attempts: the first's steps up to its checkpoint at least, the second's from there on
    with open(run / "metrics.csv") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]
    assert sorted(set(steps)) == list(range(8)) and steps[-4:] == [4, 5, 6, 7]
