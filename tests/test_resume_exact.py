"""A fit resumed from a checkpoint reproduces the uninterrupted run step for step (CPU, same seed): the data
order, the augmentation and attack random draws, the learning-rate schedule and the EMA all continue as if
the run had never stopped."""

import csv
from pathlib import Path

import pytest
import torch
from torch.utils.data import TensorDataset

from helpers import tiny_config, trainer_args
from robust_lightning.cli import main
from robust_lightning.data.loaders import EpochLoader
from robust_lightning.data.samplers import GlobalBatchSampler

STEPS_PER_EPOCH = 3


def _config(tmp_path: Path, synthetic_root: Path, **extra) -> Path:
    # heavy augmentation (RandAugment, erasing, MixUp/CutMix: every random draw source) and 1-step APGD-AT
    return tiny_config(
        tmp_path,
        synthetic_root,
        **{
            "trainer.max_epochs": 2,
            "trainer.limit_train_batches": STEPS_PER_EPOCH,
            "trainer.log_every_n_steps": 1,
            "data.batch_size": 4,
            "data.augmentation": "heavy",
            "data.image_size": 16,
            "data.source.init_args.image_size": 16,
            "data.source.init_args.train_per_class": 4,
            "data.source.init_args.val_per_class": 1,
            "model.arch": "test_resnet",
            "model.attack": "apgd",
            "model.attack_steps": 1,
            "model.ema_decay": 0.9,
            "checkpoint.save_top_k": -1,
            **extra,
        },
    )


def _train_losses(run: Path) -> dict[int, float]:
    """train/loss of every step, by global step, from the run's metrics.csv."""
    with open(run / "metrics.csv") as f:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")}


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("whole")
    config = _config(tmp_path, tmp_path_factory.mktemp("synthetic"))
    assert main(["fit", "--config", str(config)]) == 0
    return config, tmp_path / "runs" / "tiny" / "version_0"


def test_resume_at_an_epoch_boundary_reproduces_every_step(uninterrupted, tmp_path):
    config, whole = uninterrupted
    first_epoch = next((whole / "checkpoints").glob("epoch000-*.ckpt"))
    assert (
        main(
            trainer_args(
                "fit",
                config,
                {
                    "ckpt_path": str(first_epoch),
                    "trainer.default_root_dir": str(tmp_path / "runs"),
                    "trainer.logger.init_args.save_dir": str(tmp_path / "runs"),
                },
            )
        )
        == 0
    )
    resumed = tmp_path / "runs" / "tiny" / "version_0"

    expected, got = _train_losses(whole), _train_losses(resumed)
    second_epoch = list(range(STEPS_PER_EPOCH, 2 * STEPS_PER_EPOCH))
    assert sorted(expected) == list(range(2 * STEPS_PER_EPOCH)) and sorted(got) == second_epoch
    for step in second_epoch:
        assert got[step] == pytest.approx(expected[step], abs=1e-6), step
    final_whole = _weights(whole / "checkpoints" / "last.ckpt")
    final_resumed = _weights(resumed / "checkpoints" / "last.ckpt")
    assert final_whole.keys() == final_resumed.keys() and any(k.startswith("ema.") for k in final_whole)
    for name, value in final_whole.items():
        torch.testing.assert_close(final_resumed[name], value, atol=1e-6, rtol=0, msg=name)


def test_the_training_order_follows_an_epoch_set_after_the_iterator_is_created():
    # what a resumed fit does: iterator first, then set_epoch; worker processes must not have drawn indices yet
    dataset = TensorDataset(torch.arange(12))
    sampler = GlobalBatchSampler(dataset, num_replicas=1, rank=0, global_batch=4, seed=3)
    loader = EpochLoader(dataset, batch_size=4, sampler=sampler, num_workers=1, drop_last=True)
    iterator = iter(loader)
    sampler.set_epoch(5)
    first = next(iterator)[0]
    expected = torch.randperm(12, generator=torch.Generator().manual_seed(3 + 5))[:4]
    assert first.tolist() == expected.tolist()
