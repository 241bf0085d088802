"""Where the README says files go, for the statements not already checked by the test of the command that writes
them (those are: test_cli, test_writers, test_ddp_commands, test_slurm, test_sweep, test_wandb, test_evaluate,
test_export and the benchmark tests). These read the shipped configs and the code's defaults, as a run does."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from helpers import REPO
from robust_lightning.argument_parsing import compose_config
from robust_lightning.locking import LOCK_NAME
from robust_lightning.scale.sweep_spec import load_sweep

RUN_CONFIGS = sorted(  # composed with the bases they extend (configs/recipes/base), which are no runs themselves
    path
    for path in (REPO / "configs").rglob("*.yaml")
    if "base" not in path.relative_to(REPO / "configs").parts and "trainer" in (compose_config(path) or {})
)


@pytest.mark.parametrize("config", RUN_CONFIGS, ids=lambda path: str(path.relative_to(REPO / "configs")))
def test_every_shipped_run_config_writes_its_run_directories_under_runs(config):
    """README: every run directory is runs/<name>/version_N/ with the CSV logger every shipped config names; the
    run's other outputs (AutoAttack outcomes, the logger's folder) follow trainer.default_root_dir."""
    trainer = compose_config(config)["trainer"]
    loggers = trainer["logger"] if isinstance(trainer["logger"], list) else [trainer["logger"]]
    csv = loggers[0]
    assert csv["class_path"] == "lightning.pytorch.loggers.CSVLogger"
    save_dir = Path(csv["init_args"]["save_dir"])
    assert save_dir.parts[0] == "runs"
    if "default_root_dir" in trainer:  # configs/loggers/wandb.yaml only adds a logger to another config
        assert Path(trainer["default_root_dir"]) == save_dir / csv["init_args"]["name"]


def test_the_autoattack_configs_keep_their_outcomes_under_their_run_folder():
    """README: outcomes go to <default_root_dir>/autoattack/<threat model>/, runs/autoattack/autoattack/... with
    configs/eval/autoattack.yaml, runs/quickstart_autoattack/autoattack/... with the quickstart's."""
    for name, root in (("autoattack", "runs/autoattack"), ("quickstart_autoattack", "runs/quickstart_autoattack")):
        config = yaml.safe_load((REPO / "configs" / "eval" / f"{name}.yaml").read_text())
        assert config["trainer"]["default_root_dir"] == root
        callbacks = config["trainer"]["callbacks"]
        (autoattack,) = [
            c
            for c in (callbacks if isinstance(callbacks, list) else [callbacks])
            if c["class_path"].endswith("AutoAttackEvaluation")
        ]
        assert autoattack.get("init_args", {}).get("results_dir") is None  # the default: under default_root_dir


def test_the_synthetic_dataset_goes_to_data_synthetic():
    """README: the first run generates the synthetic dataset into data/synthetic/ (ROBUST_LIGHTNING_DATA moves
    data/). A new process: the data folder is read at import."""
    env = {k: v for k, v in os.environ.items() if k != "ROBUST_LIGHTNING_DATA"}
    code = (
        "from robust_lightning.data.datamodule import ImageNetDataModule; print(ImageNetDataModule().source.location())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert Path(out.stdout.strip()) == REPO / "data" / "synthetic"


def test_the_lock_file_is_the_dot_lock_the_readme_names():
    # the tests of the locks (test_writers.py) find the file by this constant
    assert LOCK_NAME == ".lock"


def test_a_sweep_without_output_dir_writes_to_runs_sweeps_name(tmp_path, monkeypatch):
    spec = {
        "name": "demo",
        "command": "validate",
        "configs": [str(REPO / "configs" / "quickstart.yaml")],
        "grid": {"data.image_size": [32, 48]},
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    monkeypatch.chdir(tmp_path)
    assert Path(load_sweep(path).output_dir).resolve() == tmp_path / "runs" / "sweeps" / "demo"


@pytest.mark.parametrize("first_logger", ["csv", "wandb", "none"])
def test_every_writer_finds_the_run_directory_by_the_same_rule(tmp_path, first_logger):
    """results.json, plots and outcomes (every rank, through Trainer.log_dir's broadcast) and predictions or an
    interrupted fit's results (rank zero alone, no collective) go to one directory, whatever the first logger."""
    from lightning import Trainer
    from lightning.pytorch.loggers import CSVLogger, WandbLogger

    from robust_lightning.paths import run_directory

    loggers = {
        "csv": [CSVLogger(tmp_path / "csv", name="run"), WandbLogger(save_dir=tmp_path / "wandb", offline=True)],
        "wandb": [WandbLogger(save_dir=tmp_path / "wandb", offline=True), CSVLogger(tmp_path / "csv", name="run")],
        "none": False,
    }[first_logger]
    trainer = Trainer(logger=loggers, default_root_dir=tmp_path / "root", accelerator="cpu", enable_progress_bar=False)
    expected = {"csv": tmp_path / "csv" / "run" / "version_0", "wandb": tmp_path / "wandb", "none": tmp_path / "root"}
    assert run_directory(trainer) == run_directory(trainer, every_rank=True) == expected[first_logger]


def test_the_quickstarts_first_stage_writes_where_the_readme_says(tmp_path, monkeypatch, capsys):
    """README: configs/quickstart_clean.yaml writes runs/quickstart_clean/checkpoints/last.ckpt, and a second fit
    of it refuses to overwrite them. The shipped config with the user's defaults (bar, loader workers), shrunk to a
    tiny model and a few images; run from a fresh directory, as runs/ is relative."""
    from robust_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    args = ["fit", "--config", str(REPO / "configs" / "quickstart_clean.yaml"), "--model.arch", "test_resnet",
            "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
            "--data.source.root", str(tmp_path / "synthetic"), "--data.source.train_per_class", "8",
            "--data.source.val_per_class", "4", "--data.source.samples_per_shard", "20"]  # fmt: skip
    assert main(args) == 0
    assert (tmp_path / "runs" / "quickstart_clean" / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "runs" / "quickstart_clean" / "version_0" / "results.json").is_file()
    capsys.readouterr()
    assert main(args) == 2  # the fixed checkpoint folder belongs to the first fit
    assert "runs/quickstart_clean/checkpoints" in capsys.readouterr().err
