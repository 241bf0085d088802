"""A checkpoint is self-contained: once trained from a warm start, it is evaluated, exported, resumed and loaded
with its warm-start file gone (another machine, another folder), and a setting given beside --ckpt_path either
applies or stops the run with a message saying which checkpoint setting wins."""

import json
import shutil

import numpy as np
import pytest
import torch
import yaml
from lightning import Trainer

from helpers import tiny_config, trainer_args
from robust_lightning import load_model
from robust_lightning.cli import main
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.sources import SyntheticSource
from robust_lightning.models.checkpoints import save_net_weights
from robust_lightning.models.classifier import build_classifier
from robust_lightning.training.lightning_module import ImageClassifier

MEAN, STD = (0.4, 0.45, 0.5), (0.2, 0.25, 0.3)


@pytest.fixture(scope="module")
def moved_checkpoint(tmp_path_factory):
    """A run warm-started from a file (with a normaliser of its own) that is then deleted; the checkpoint is
    moved to another folder. Returns (config naming the deleted init_from, checkpoint)."""
    tmp_path = tmp_path_factory.mktemp("portable")
    warm = save_net_weights(build_classifier("test_convnext", 4, mean=MEAN, std=STD), tmp_path / "warm.safetensors")
    config = tiny_config(
        tmp_path,
        **{"model.arch": "test_convnext", "model.init_from": str(warm), "trainer.limit_train_batches": 1},
    )
    assert main(["fit", "--config", str(config)]) == 0
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ckpt = shutil.move(tmp_path / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt", elsewhere / "m.ckpt")
    warm.unlink()
    return config, ckpt


def results_of(save_dir, stage):
    return json.loads(next(save_dir.glob("tiny/version_*/results.json")).read_text())[stage]


def independent_top1(ckpt, config) -> float:
    """Top-1 on the val split computed here: the checkpoint's tensors, no warm-start file, no Lightning."""
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    model = ImageClassifier(**{k: v for k, v in state["hyper_parameters"].items() if not k.startswith("_")})
    model.load_state_dict(state["state_dict"])  # holds the adopted normaliser as buffers
    model.eval()
    dm = ImageNetDataModule(
        source=SyntheticSource(**yaml.safe_load(config.read_text())["data"]["source"]["init_args"]),
        image_size=32,
        num_workers=0,
    )
    dm.setup("validate")
    with torch.no_grad():
        pairs = [(model(b["image"].float() / 255).argmax(1).numpy(), b["label"].numpy()) for b in dm.val_dataloader()]
    return float(np.mean(np.concatenate([p for p, _ in pairs]) == np.concatenate([label for _, label in pairs])))


def test_the_checkpoint_records_the_warm_start_normaliser(moved_checkpoint):
    _, ckpt = moved_checkpoint
    saved = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert saved["hyper_parameters"]["mean"] == pytest.approx(MEAN)
    assert saved["hyper_parameters"]["std"] == pytest.approx(STD)
    assert torch.allclose(saved["state_dict"]["model.normalize.mean"].flatten(), torch.tensor(MEAN))


@pytest.mark.parametrize("command", ["validate", "test", "predict"])
def test_evaluation_never_reads_the_deleted_warm_start_file(moved_checkpoint, tmp_path, command, capsys):
    config, ckpt = moved_checkpoint
    assert (
        main(
            [
                command,
                "--config",
                str(config),
                "--ckpt_path",
                str(ckpt),
                "--trainer.logger.init_args.save_dir",
                str(tmp_path),
            ]
        )
        == 0
    ), capsys.readouterr().err[-2000:]
    if command == "validate":
        assert results_of(tmp_path, "validate")["metrics"]["val/acc1"] == pytest.approx(independent_top1(ckpt, config))


def test_init_from_null_beside_the_checkpoint_is_accepted(moved_checkpoint, tmp_path):
    config, ckpt = moved_checkpoint
    assert (
        main(
            trainer_args(
                "validate",
                config,
                {"ckpt_path": str(ckpt), "model.init_from": "null", "trainer.logger.init_args.save_dir": str(tmp_path)},
            )
        )
        == 0
    )
    assert results_of(tmp_path, "validate")["metrics"]["val/acc1"] == pytest.approx(independent_top1(ckpt, config))


def test_fit_resumes_without_the_warm_start_file(moved_checkpoint, tmp_path):
    config, ckpt = moved_checkpoint
    assert (
        main(
            trainer_args(
                "fit",
                config,
                {"ckpt_path": str(ckpt), "trainer.max_epochs": "2", "trainer.logger.init_args.save_dir": str(tmp_path)},
            )
        )
        == 0
    )
    assert results_of(tmp_path, "fit")["epochs"] == 2


def test_export_and_load_model_never_read_the_warm_start_file(moved_checkpoint, tmp_path):
    _config, ckpt = moved_checkpoint
    assert main(["export", str(ckpt), str(tmp_path / "w.safetensors")]) == 0
    model = load_model(None, ckpt)
    exported = load_model("test_convnext", tmp_path / "w.safetensors")
    x = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model(x), exported(x), atol=1e-6)
    assert torch.allclose(model.normalize.mean.flatten(), torch.tensor(MEAN))


def test_load_from_checkpoint_then_evaluate_keeps_the_checkpoint_weights(moved_checkpoint):
    config, ckpt = moved_checkpoint
    module = ImageClassifier.load_from_checkpoint(ckpt, weights_only=True)
    before = {k: v.clone() for k, v in module.state_dict().items()}
    dm = ImageNetDataModule(
        source=SyntheticSource(**yaml.safe_load(config.read_text())["data"]["source"]["init_args"]),
        image_size=32,
        num_workers=0,
    )
    trainer = Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_checkpointing=False, inference_mode=False
    )
    trainer.validate(module, datamodule=dm, verbose=False)
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())


@pytest.mark.parametrize(
    "command,option,value,wins",
    [
        ("validate", "arch", "test_vit", "the checkpoint's arch 'test_convnext'"),
        ("test", "ema_decay", "0.99", "the checkpoint's ema_decay None"),
        ("fit", "lr", "0.5", "the checkpoint's lr 0.001"),
    ],
)
def test_a_setting_the_checkpoint_decides_stops_the_run(moved_checkpoint, command, option, value, wins, capsys):
    config, ckpt = moved_checkpoint
    assert main([command, "--config", str(config), "--ckpt_path", str(ckpt), f"--model.{option}", value]) == 2
    err = capsys.readouterr().err
    assert f"--model.{option} " in err and wins in err and str(ckpt) in err and "drop the option" in err
    assert "Traceback" not in err


def test_a_setting_of_the_evaluation_applies_over_the_checkpoint(moved_checkpoint, tmp_path):
    # the checkpoint was trained without a selection attack; the flag makes validation measure robust accuracy
    config, ckpt = moved_checkpoint
    assert (
        main(
            trainer_args(
                "validate",
                config,
                {
                    "ckpt_path": str(ckpt),
                    "model.select_attack_steps": "1",
                    "model.lr": "0.5",
                    "trainer.logger.init_args.save_dir": str(tmp_path),
                },
            )
        )
        == 0
    )
    results = results_of(tmp_path, "validate")
    assert 0 <= results["metrics"]["val/robust_acc"] <= results["metrics"]["val/acc1"]
    assert "APGD-CE 1 steps" in results["conditions"]["model"]["selection"]["metric"]
