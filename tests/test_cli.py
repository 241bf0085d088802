"""The command line end to end, through robust_lightning.cli.main, on a tiny synthetic dataset."""

import json
import re

import numpy as np
import pytest
import torch
import yaml

from helpers import REPO, folder_source, run_cli, tiny_config, trainer_args
from robust_lightning.cli import main
from robust_lightning.data.datamodule import ImageNetDataModule
from robust_lightning.data.sources import SyntheticSource
from robust_lightning.training.lightning_module import ImageClassifier


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """One short fit shared by the tests that need a trained run."""
    tmp_path = tmp_path_factory.mktemp("fit")
    config = tiny_config(tmp_path)
    assert main(["fit", "--config", str(config)]) == 0
    run_dir = tmp_path / "runs" / "tiny" / "version_0"
    return config, run_dir


def test_help_lists_the_subcommands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("fit", "validate", "test", "predict", "shards"):
        assert f"\n  {command} " in out


def test_fit_writes_checkpoints_and_results(fitted):
    _, run_dir = fitted
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    (best,) = (run_dir / "checkpoints").glob("epoch*.ckpt")  # the best one, named as the README says
    assert re.fullmatch(r"epoch\d{3}-select\d\.\d{4}\.ckpt", best.name), best.name
    assert (run_dir / "config.yaml").is_file()
    results = json.loads((run_dir / "results.json").read_text())
    fit = results["fit"]
    assert fit["metrics"]["val/num_images"] == 16  # 4 classes x 4 val images, each counted once
    assert 0.0 <= fit["metrics"]["val/acc1"] <= 1.0
    assert fit["best_checkpoint"]["sha256"] and fit["monitor"] == "val/select_acc"
    conditions = fit["conditions"]
    assert conditions["model"]["arch"] == "convnext_atto_convstem"
    assert conditions["data"]["image_size"] == 32 and conditions["seed"] == 0
    assert conditions["precision"] == "32-true"
    assert {"torch", "lightning", "timm", "python"} <= conditions["versions"].keys()


def test_validate_accuracy_matches_an_independent_computation(fitted, tmp_path):
    config, run_dir = fitted
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    assert (
        main(
            trainer_args(
                "validate", config, {"ckpt_path": str(ckpt), "trainer.logger.init_args.save_dir": str(tmp_path)}
            )
        )
        == 0
    )
    results = json.loads(next(tmp_path.glob("tiny/version_*/results.json")).read_text())["validate"]
    assert results["checkpoint"]["path"] == str(ckpt.resolve())

    # independent: load the weights ourselves, run every val image, count correct top-1/top-5 with numpy
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    model = ImageClassifier(**{k: v for k, v in state["hyper_parameters"].items() if not k.startswith("_")})
    model.load_state_dict(state["state_dict"])
    model.eval()
    synthetic = SyntheticSource(**yaml.safe_load(config.read_text())["data"]["source"]["init_args"])
    dm = ImageNetDataModule(source=synthetic, image_size=32, num_workers=0)
    dm.setup("validate")
    logits, labels = [], []
    with torch.no_grad():
        for batch in dm.val_dataloader():
            logits.append(model(batch["image"].float() / 255).numpy())
            labels.append(batch["label"].numpy())
    logits, labels = np.concatenate(logits), np.concatenate(labels)
    top5 = np.argsort(-logits, axis=1)[:, :5]
    assert results["metrics"]["val/acc1"] == pytest.approx((logits.argmax(1) == labels).mean(), abs=1e-6)
    assert results["metrics"]["val/acc5"] == pytest.approx((top5 == labels[:, None]).any(1).mean(), abs=1e-6)
    assert results["metrics"]["val/num_images"] == len(labels) == 16


def test_resume_from_checkpoint_continues_training(fitted, tmp_path):
    config, run_dir = fitted
    ckpt = run_dir / "checkpoints" / "last.ckpt"
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
    results = json.loads(next(tmp_path.glob("tiny/version_*/results.json")).read_text())["fit"]
    assert results["epochs"] == 2 and results["steps"] == 6  # 3 steps per epoch, continued from step 3


def test_configs_compose_left_to_right_and_print_config(tmp_path, capsys):
    config = tiny_config(tmp_path)
    override = tmp_path / "override.yaml"
    override.write_text("model:\n  lr: 0.5\ntrainer:\n  max_epochs: 7\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(config), "--config", str(override), "--trainer.max_epochs", "9", "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["model"]["lr"] == 0.5  # from the second file
    assert printed["trainer"]["max_epochs"] == 9  # the flag wins over both files
    assert printed["model"]["arch"] == "convnext_atto_convstem"  # from the first file
    assert printed["checkpoint"]["monitor"] == "val/select_acc"


@pytest.mark.parametrize(
    "extra,expected",
    [
        (["--model.lrr", "0.1"], "lrr"),
        (["--trainer.max_epochs", "many"], "max_epochs"),
        (["--data.source", "imagenet"], "source"),
    ],
)
def test_user_errors_exit_nonzero_with_a_message_and_no_traceback(tmp_path, extra, expected):
    config = tiny_config(tmp_path)
    result = run_cli("fit", "--config", str(config), *extra)
    assert result.returncode != 0
    assert expected in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_config_file_is_reported(tmp_path):
    result = run_cli("fit", "--config", str(tmp_path / "nope.yaml"))
    assert result.returncode != 0
    assert "nope.yaml" in result.stderr and "Traceback" not in result.stderr


def test_missing_dataset_is_reported(tmp_path):
    config = tiny_config(tmp_path, **{"data.source": folder_source(tmp_path / "imagenet")})
    result = run_cli("fit", "--config", str(config))
    assert result.returncode == 2
    assert "imagenet does not exist" in result.stderr and "train/" in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_warm_start_checkpoint_is_reported(tmp_path):
    config = tiny_config(tmp_path, **{"model.init_from": str(tmp_path / "weights.safetensors")})
    result = run_cli("fit", "--config", str(config))
    assert result.returncode == 2
    assert "weights.safetensors" in result.stderr and "Traceback" not in result.stderr


def test_unknown_command_is_reported(capsys):
    assert main(["train"]) == 2
    assert "unknown command 'train'" in capsys.readouterr().err


def test_environment_variables_set_options(tmp_path):
    # environment variables replace defaults; config files and flags still override them
    config = tiny_config(tmp_path)
    content = yaml.safe_load(config.read_text())
    del content["trainer"]["max_epochs"]
    config.write_text(yaml.safe_dump(content))
    result = run_cli("fit", "--config", str(config), "--print_config", env={"RL_FIT__TRAINER__MAX_EPOCHS": "4"})
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["trainer"]["max_epochs"] == 4


def test_predict_writes_top5_predictions(fitted, tmp_path):
    config, run_dir = fitted
    assert (
        main(
            trainer_args(
                "predict",
                config,
                {
                    "ckpt_path": str(run_dir / "checkpoints" / "last.ckpt"),
                    "trainer.logger.init_args.save_dir": str(tmp_path),
                },
            )
        )
        == 0
    )
    rows = next(tmp_path.glob("tiny/version_*/predictions-rank0.csv")).read_text().splitlines()
    assert rows[0] == "key,label,top5,top5_prob" and len(rows) == 1 + 16
    _key, _label, top5, probs = rows[1].split(",")
    assert len(top5.split()) == 4 and abs(sum(map(float, probs.split())) - 1) < 1e-3  # 4 classes: all of them


def test_shards_command_converts_a_folder(tmp_path, capsys):
    from helpers import WNIDS, make_image_tree

    make_image_tree(tmp_path / "val", {w: 2 for w in WNIDS})
    assert (
        main(["shards", str(tmp_path / "val"), str(tmp_path / "out"), "--samples_per_shard", "4", "--workers", "1"])
        == 0
    )
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["num_samples"] == 6 and len(manifest["shards"]) == 2
    assert main(["shards", str(tmp_path / "missing"), str(tmp_path / "out2")]) == 2
    assert "missing" in capsys.readouterr().err


def test_wandb_logger_config_composes(tmp_path, capsys):
    config = tiny_config(tmp_path)
    with pytest.raises(SystemExit):
        main(["fit", "--config", str(config), "--config", str(REPO / "configs/loggers/wandb.yaml"), "--print_config"])
    loggers = yaml.safe_load(capsys.readouterr().out)["trainer"]["logger"]
    assert [logger["class_path"].rsplit(".", 1)[1] for logger in loggers] == ["CSVLogger", "WandbLogger"]


def test_corrupt_images_are_skipped_counted_and_reported(tmp_path, caplog):
    from helpers import WNIDS, make_image_tree

    make_image_tree(tmp_path / "imagenet" / "val", {w: 2 for w in WNIDS}, corrupt=["n01440764/n01440764_bad.JPEG"])
    config = tiny_config(
        tmp_path,
        **{"data.source": folder_source(tmp_path / "imagenet"), "model.arch": "test_convnext"},
    )
    assert main(["validate", "--config", str(config)]) == 0
    results = json.loads(next(tmp_path.glob("runs/tiny/version_*/results.json")).read_text())["validate"]
    assert results["metrics"]["val/num_images"] == 6
    assert results["metrics"]["val/corrupt_images"] == 1
    assert results["corrupt_images"] == {"val": 1}
    assert "n01440764_bad.JPEG" in caplog.text


def test_fit_warm_starts_a_convstem_model_from_a_patchstem_checkpoint(tmp_path):
    import safetensors.torch

    from robust_lightning.models.classifier import build_classifier

    source = build_classifier("convnext_atto", num_classes=4).net
    safetensors.torch.save_file(source.state_dict(), str(tmp_path / "convnext_atto.safetensors"))
    config = tiny_config(
        tmp_path,
        **{"model.init_from": str(tmp_path / "convnext_atto.safetensors"), "trainer.limit_train_batches": 1},
    )
    assert main(["fit", "--config", str(config)]) == 0
    results = json.loads(next(tmp_path.glob("runs/tiny/version_*/results.json")).read_text())
    model = results["fit"]["conditions"]["model"]
    assert model["init_from"].endswith("convnext_atto.safetensors")
    assert "stem.0.weight" in model["warm_start"]  # the new ConvStem is reported as newly initialised


def test_checkpoint_of_another_architecture_is_refused_clearly(fitted, tmp_path):
    # LightningCLI restores the checkpoint's own hyperparameters (arch), but the label space comes from the
    # data: a 4-class checkpoint cannot be evaluated on 1000-class ImageNet folders
    from helpers import WNIDS, make_image_tree

    config, run_dir = fitted
    make_image_tree(tmp_path / "imagenet" / "val", {w: 1 for w in WNIDS})
    result = run_cli(
        "validate",
        "--config",
        str(config),
        "--data.source",
        "FolderSource",
        "--data.source.root",
        str(tmp_path / "imagenet"),
        "--ckpt_path",
        str(run_dir / "checkpoints" / "last.ckpt"),
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "'convnext_atto_convstem' model (num_classes 4" in result.stderr and "mismatched keys" in result.stderr
    assert "model.net.head.fc.weight (checkpoint (4, 320) vs model (1000, 320))" in result.stderr
    assert "Traceback" not in result.stderr


def test_checkpoints_given_with_ckpt_path_load_weights_only(fitted, tmp_path, monkeypatch):
    config, run_dir = fitted
    seen = []
    original = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: seen.append(k.get("weights_only")) or original(*a, **k))
    assert (
        main(
            trainer_args(
                "validate",
                config,
                {
                    "ckpt_path": str(run_dir / "checkpoints" / "last.ckpt"),
                    "trainer.logger.init_args.save_dir": str(tmp_path),
                },
            )
        )
        == 0
    )
    assert seen and all(flag is True for flag in seen)


def test_last_checkpoint_is_the_latest_epoch_even_when_the_score_did_not_improve(tmp_path):
    # monitor 'epoch' in mode min: epoch 0 stays the best, so no top-k checkpoint is saved after it (Lightning 2.6
    # then left last.ckpt at epoch 0, and --ckpt_path last silently trained the later epochs again)
    config = tiny_config(
        tmp_path,
        **{"trainer.max_epochs": 3, "trainer.limit_train_batches": 2, "model.arch": "test_resnet"},
    )
    assert main(["fit", "--config", str(config), "--checkpoint.monitor", "epoch", "--checkpoint.mode", "min"]) == 0
    checkpoints = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints"
    last = torch.load(checkpoints / "last.ckpt", map_location="cpu", weights_only=True)
    assert (last["epoch"], last["global_step"]) == (2, 6)
    assert [p.name[:8] for p in checkpoints.glob("epoch*.ckpt")] == ["epoch000"]
    # the best score and path of ModelCheckpoint's state travel under its own key, as Lightning wrote them
    state = next(v for k, v in last["callbacks"].items() if k.startswith("ModelCheckpoint{"))
    assert state["best_model_path"].endswith(".ckpt") and state["best_model_score"] == 0


def test_a_config_without_a_logger_writes_its_run_directory_under_lightning_logs(tmp_path):
    """What the README says: without a logger in the config, Lightning's default run directory."""
    config = yaml.safe_load(tiny_config(tmp_path, **{"model.arch": "test_resnet"}).read_text())
    del config["trainer"]["logger"]
    path = tmp_path / "no_logger.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["fit", "--config", str(path)]) == 0
    run = tmp_path / "runs" / "lightning_logs" / "version_0"
    assert (run / "results.json").is_file() and (run / "config.yaml").is_file()
    assert list((run / "checkpoints").glob("last.ckpt"))


SILENCED = ("💡 Tip", "LeafSpec", "tensorboardX", "has `__len__` defined", "The dirpath has changed")


def test_a_short_fit_and_validate_print_none_of_the_silenced_notices(tmp_path):
    """robust_lightning/startup.py names them; Lightning's warnings that tell a user something stay."""
    config = tiny_config(tmp_path)
    fit = run_cli("fit", "--config", str(config))
    assert fit.returncode == 0, fit.stderr[-3000:]
    assert "smaller than the logging interval" in fit.stderr  # kept: a user can act on it
    ckpt = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt"
    other = tmp_path / "other"  # another run folder, and Lightning's default logger (tensorboard not installed)
    args = ["--ckpt_path", str(ckpt), "--trainer.logger", "true", "--trainer.default_root_dir", str(other)]
    validate = run_cli("validate", "--config", str(config), *args)
    assert validate.returncode == 0, validate.stderr[-3000:]
    for output in (fit.stdout + fit.stderr, validate.stdout + validate.stderr):
        assert not [line for line in output.splitlines() if any(notice in line for notice in SILENCED)]
