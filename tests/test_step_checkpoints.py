"""``checkpoint.every_n_train_steps`` bounds the work a kill loses from the first epoch on, and the best checkpoint
is still chosen at a validation's end with the score of the weights it saves (issue 44). With the default monitor
(val/select_acc), which no step of the first epoch has logged yet: Lightning's own step saves would write nothing
until then, and turn the epoch-end saves off."""

import csv
import json
import os
import signal
from pathlib import Path

import torch
from lightning import Callback

from helpers import run_command, tiny_config

STEPS_PER_EPOCH, EPOCHS, EVERY = 6, 2, 2


class KillAt(Callback):
    """``kill -9`` of this process at the end of training step ``step`` (a node's failure)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def config(tmp_path: Path, callbacks: list) -> Path:
    return tiny_config(
        tmp_path,
        **{
            "trainer.max_epochs": EPOCHS,
            "trainer.limit_train_batches": None,
            "trainer.log_every_n_steps": 1,
            "trainer.callbacks": callbacks,
            "data.batch_size": 4,
            "data.source.init_args.train_per_class": STEPS_PER_EPOCH,  # 4 classes: 6 steps of 4 images
            "model.arch": "test_resnet",
            "model.select_attack_steps": 1,
            "checkpoint.every_n_train_steps": EVERY,  # the monitor is the default one
        },
    )


def step_of(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def test_a_step_checkpoint_comes_in_the_first_epoch_and_the_best_is_an_epoch_end_one(tmp_path):
    run = tmp_path / "runs" / "tiny" / "version_0"
    killed = run_command(
        [
            "fit",
            "--config",
            str(config(tmp_path, [{"class_path": "test_step_checkpoints.KillAt", "init_args": {"step": 5}}])),
        ],
        cwd=tmp_path,
        timeout=240,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    # steps 2 and 4 of the first epoch were saved to resume from, before any validation logged the monitor
    assert step_of(run / "checkpoints" / "last.ckpt") == 4
    assert [p.name for p in (run / "checkpoints").glob("*.ckpt")] == ["last.ckpt"]  # no score yet: no best file

    resumed = run_command(
        ["fit", "--config", str(config(tmp_path, [])), "--ckpt_path", "last"], cwd=tmp_path, timeout=240
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout + resumed.stderr and "step 4" in resumed.stdout + resumed.stderr

    # the best checkpoint was saved at a validation's end, and holds the score of that validation's weights
    fit = json.loads((run / "results.json").read_text())["fit"]
    best = Path(fit["best_checkpoint"]["path"])
    assert step_of(best) % STEPS_PER_EPOCH == 0, best
    with open(run / "metrics.csv", newline="") as file:
        scores = {
            int(row["step"]): float(row["val/select_acc"]) for row in csv.DictReader(file) if row["val/select_acc"]
        }
    assert scores[step_of(best) - 1] == fit["best_score"] == max(scores.values())  # metrics.csv counts steps from 0
    assert step_of(run / "checkpoints" / "last.ckpt") == EPOCHS * STEPS_PER_EPOCH
