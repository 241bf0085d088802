"""The numbers a user types for Lightning's batch limits mean what Lightning documents (issue 44): an int is a number
of batches and a float a fraction, so ``--trainer.limit_train_batches 1`` is one batch and 1.0 the whole epoch, from
the command line, a config file and the environment. Lightning 2.6 types the limits ``float | int``, so without the
project's parser 1 became 1.0, a full epoch where the user asked for a one-batch smoke run."""

import json

import pytest
import torch
import yaml

from helpers import tiny_config
from robust_lightning.cli import main


def printed(capsys, *args: str) -> dict:
    with pytest.raises(SystemExit) as ended:
        main(["fit", *args, "--print_config"])
    assert ended.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)["trainer"]


@pytest.mark.parametrize("name", ["limit_train_batches", "limit_val_batches", "limit_test_batches"])
def test_one_is_one_batch_and_one_point_zero_all_from_the_command_line(tmp_path, capsys, name):
    config = tiny_config(tmp_path)
    assert printed(capsys, "--config", str(config), f"--trainer.{name}", "1")[name] == 1
    whole = printed(capsys, "--config", str(config), f"--trainer.{name}", "1.0")[name]
    assert whole == 1.0 and isinstance(whole, float)
    assert printed(capsys, "--config", str(config), f"--trainer.{name}", "0.25")[name] == 0.25


def test_a_config_file_and_the_environment_keep_an_int_an_int(tmp_path, capsys, monkeypatch):
    config = tiny_config(tmp_path, **{"trainer.limit_train_batches": 1, "trainer.limit_val_batches": 1.0})
    trainer = printed(capsys, "--config", str(config))
    assert trainer["limit_train_batches"] == 1 and isinstance(trainer["limit_train_batches"], int)
    assert trainer["limit_val_batches"] == 1.0 and isinstance(trainer["limit_val_batches"], float)
    monkeypatch.setenv("RL_FIT__TRAINER__LIMIT_TEST_BATCHES", "1")
    assert printed(capsys, "--config", str(config))["limit_test_batches"] == 1
    # Lightning's others that take both already put int first; they still do
    trainer = printed(
        capsys, "--config", str(config), "--trainer.overfit_batches", "1", "--trainer.val_check_interval", "1"
    )
    assert trainer["overfit_batches"] == 1 and trainer["val_check_interval"] == 1


def test_a_fit_with_limit_train_batches_1_trains_one_step_and_validates_one_batch(tmp_path):
    config = tiny_config(tmp_path, **{"trainer.limit_train_batches": None, "model.arch": "test_resnet"})
    # 4 classes x 8 training images in batches of 8: 4 steps an epoch; 16 validation images in batches of 8
    assert (
        main(["fit", "--config", str(config), "--trainer.limit_train_batches", "1", "--trainer.limit_val_batches", "1"])
        == 0
    )
    run = tmp_path / "runs" / "tiny" / "version_0"
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 1
    assert json.loads((run / "results.json").read_text())["fit"]["metrics"]["val/num_images"] == 8
