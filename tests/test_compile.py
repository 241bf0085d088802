"""model.compile: torch.compile of the network gives the eager run's training, step for step (CPU, inductor)."""

import csv
from pathlib import Path

import pytest

from helpers import tiny_config
from robust_lightning.cli import main


def train_losses(run: Path) -> list[float]:
    with open(run / "metrics.csv") as f:
        return [float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")]


def test_three_compiled_steps_give_the_eager_losses(tmp_path):
    """APGD-AT on a model without BatchNorm (the attack's last forward reused, the re-forward bucketed); the
    attack's passes run with detached parameters, compiled or not."""
    losses = {}
    for compiled in (False, True):
        (tmp_path / str(compiled)).mkdir()
        config = tiny_config(
            tmp_path / str(compiled),
            **{
                "trainer.max_steps": 3,
                "trainer.log_every_n_steps": 1,
                "trainer.limit_val_batches": 0,
                "model.arch": "test_vit",
                "model.attack": "apgd",
                "model.attack_steps": 1,
                "model.compile": compiled,
                "data.batch_size": 8,
            },
        )
        assert main(["fit", "--config", str(config)]) == 0
        losses[compiled] = train_losses(tmp_path / str(compiled) / "runs" / "tiny" / "version_0")
    assert len(losses[False]) == 3
    assert losses[True] == pytest.approx(losses[False], rel=1e-4, abs=1e-5)
