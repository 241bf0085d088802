"""A fit that SLURM restarts (a requeued job: ``SLURM_RESTART_COUNT`` > 0) with no ``--ckpt_path`` goes on as
``--ckpt_path last`` (robust_lightning/scale/requeue.py), from the checkpoint furthest in training: a job pre-empted
without the requeue signal (SLURM's SIGTERM; the fit writes last.ckpt of its stop step) continues its run instead of
training it again from the start, or again from an older hpc checkpoint. Without a cluster: the environment SLURM
gives the job's task."""

import csv
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from jsonargparse import Namespace
from lightning import Trainer
from lightning.pytorch.trainer.states import TrainerFn

from helpers import fake_slurm_job, run_command, tiny_config
from robust_lightning.scale.requeue import continue_slurm_restart
from robust_lightning.training.run_directory import hpc_checkpoints

STEPS = 8  # 2 epochs of 4 steps
STOP = 3  # SIGTERM inside step 3: last.ckpt of step 3


def srun_task(job_id: str = "4243") -> dict[str, str]:
    """The environment of the one task of a batch job's srun step (Lightning's SLURM environment detects it)."""
    return {
        "SLURM_JOB_ID": job_id,
        "SLURM_JOB_NAME": "restart-test",
        "SLURM_NTASKS": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_NODELIST": "localhost",
    }


def test_a_sigterm_stop_then_the_slurm_restart_of_the_same_command_continues_from_last_ckpt(tmp_path):
    """slurm/train_multinode.sbatch's layout (everything in RUN_DIR: default_root_dir, CSV log without version,
    checkpoints). Attempt 1 is stopped by SIGTERM in step 3, without a requeue signal before it: last.ckpt of step 3,
    no hpc checkpoint, exit 143. Attempt 2 is the same command with SLURM_RESTART_COUNT=1: it resumes from last.ckpt
    and trains steps 4 to 8 once; metrics.csv keeps attempt 1's rows and has each step once."""
    run_dir = tmp_path / "run"
    record = tmp_path / "steps.jsonl"
    callbacks = [
        {"class_path": "slurm_cluster.Pace", "init_args": {"record": str(record), "seconds": 0}},
        {"class_path": "slurm_cluster.SignalMidStep", "init_args": {"step": STOP, "signal_name": "SIGTERM"}},
    ]
    config = tiny_config(
        tmp_path,
        **{
            "trainer.max_epochs": 2,
            "trainer.limit_train_batches": STEPS // 2,
            "trainer.log_every_n_steps": 1,
            "trainer.default_root_dir": str(run_dir),
            "trainer.logger": {
                "class_path": "robust_lightning.loggers.CSVLogger",
                "init_args": {"save_dir": str(run_dir), "name": "", "version": ""},
            },
            "trainer.callbacks": callbacks,
            "checkpoint.dirpath": str(run_dir / "checkpoints"),
            "data.batch_size": 2,
            "data.source.init_args.train_per_class": 4,
            "model.arch": "test_resnet",
        },
    )
    command = ["fit", "--config", str(config)]
    first = run_command(command, cwd=tmp_path, timeout=240, env=srun_task())
    output = first.stdout + first.stderr
    assert first.returncode == 143, output[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert torch.load(last, map_location="cpu", weights_only=True)["global_step"] == STOP
    assert not list(run_dir.glob("*hpc_ckpt_*"))  # nothing Lightning would resume from by itself

    # SLURM's restart: the same command (the callbacks of the config, but for the stop), attempt 2
    restart = run_command(
        [*command, "--trainer.callbacks", json.dumps(callbacks[:1])],
        cwd=tmp_path,
        timeout=240,
        env={**srun_task(), "SLURM_RESTART_COUNT": "1"},
    )
    output = restart.stdout + restart.stderr
    assert restart.returncode == 0, output[-3000:]
    assert "SLURM restarted this job (1 restarts so far): the fit goes on as --ckpt_path last" in output
    assert f"Restoring states from the checkpoint path at {last}" in output
    steps = [(r["attempt"], r["step"]) for r in map(json.loads, record.read_text().splitlines())]
    assert steps == [(0, s) for s in range(1, STOP + 1)] + [(1, s) for s in range(STOP + 1, STEPS + 1)]
    fit = json.loads((run_dir / "results.json").read_text())["fit"]
    assert fit["steps"] == STEPS and "interrupted" not in fit
    with open(run_dir / "metrics.csv") as f:
        logged = Counter(int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss"))
    assert logged == Counter(range(STEPS))  # metrics.csv numbers steps from 0: each once, attempt 1's kept


def test_a_restart_after_a_requeue_and_a_later_sigterm_goes_on_from_the_newer_checkpoint(tmp_path):
    """Attempt 1 is requeued in step 2 (SLURM's requeue signal: hpc_ckpt_1.ckpt of step 2). Attempt 2 resumes from
    it and is stopped by SIGTERM in step 5, without a requeue signal (pre-emption: last.ckpt of step 5). Attempt 3
    goes on from last.ckpt, not from the older hpc checkpoint Lightning would take by itself: each step is trained
    once, and the final weights are those of the same fit left alone. With a user's defaults: the progress
    display and a loader worker."""
    record = tmp_path / "steps.jsonl"
    pace = {"class_path": "slurm_cluster.Pace", "init_args": {"record": str(record), "seconds": 0}}

    def stop(step: int, name: str) -> dict:
        return {"class_path": "slurm_cluster.SignalMidStep", "init_args": {"step": step, "signal_name": name}}

    def fit_config(folder: Path) -> Path:
        run_dir = folder / "run"
        return tiny_config(
            folder,
            **{
                "trainer.max_epochs": 2,
                "trainer.limit_train_batches": STEPS // 2,
                "trainer.enable_progress_bar": True,
                "trainer.default_root_dir": str(run_dir),
                "trainer.logger": {
                    "class_path": "robust_lightning.loggers.CSVLogger",
                    "init_args": {"save_dir": str(run_dir), "name": "", "version": ""},
                },
                "checkpoint.dirpath": str(run_dir / "checkpoints"),
                "data.batch_size": 2,
                "data.num_workers": 1,
                "data.source.init_args.train_per_class": 4,
                "model.arch": "test_resnet",
            },
        )

    config, run_dir = fit_config(tmp_path), tmp_path / "run"
    job = fake_slurm_job(tmp_path)
    for restarts, callbacks, status in ((0, [pace, stop(2, "SIGUSR1")], 143), (1, [pace, stop(5, "SIGTERM")], 143)):
        attempt = run_command(
            ["fit", "--config", str(config), "--trainer.callbacks", json.dumps(callbacks)],
            cwd=tmp_path,
            timeout=240,
            env={**job, "SLURM_RESTART_COUNT": str(restarts)},
        )
        assert attempt.returncode == status, (attempt.stdout + attempt.stderr)[-3000:]
    hpc, last = run_dir / "hpc_ckpt_1.ckpt", run_dir / "checkpoints" / "last.ckpt"
    assert [torch.load(p, map_location="cpu", weights_only=True)["global_step"] for p in (hpc, last)] == [2, 5]

    third = run_command(
        ["fit", "--config", str(config), "--trainer.callbacks", json.dumps([pace])],
        cwd=tmp_path,
        timeout=240,
        env={**job, "SLURM_RESTART_COUNT": "2"},
    )
    output = third.stdout + third.stderr
    assert third.returncode == 0, output[-3000:]
    assert f"resuming from {last}, the newest intact checkpoint by training step (step 5" in output
    steps = [(r["attempt"], r["step"]) for r in map(json.loads, record.read_text().splitlines())]
    assert steps == [(0, 1), (0, 2), (1, 3), (1, 4), (1, 5), (2, 6), (2, 7), (2, 8)]

    alone_dir = tmp_path / "alone"
    alone_dir.mkdir()
    alone = run_command(["fit", "--config", str(fit_config(alone_dir))], cwd=alone_dir, timeout=240)
    assert alone.returncode == 0, alone.stderr[-3000:]
    expected, got = (
        torch.load(folder / "run" / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        for folder in (alone_dir, tmp_path)
    )
    assert got["global_step"] == expected["global_step"] == STEPS
    assert expected["state_dict"].keys() == got["state_dict"].keys()
    for key, value in expected["state_dict"].items():
        assert torch.equal(got["state_dict"][key], value), key


def _config(tmp_path: Path, ckpt_path: str | None = None) -> Namespace:
    return Namespace(ckpt_path=ckpt_path, trainer=Namespace(default_root_dir=str(tmp_path)))


@pytest.mark.parametrize("srun", [True, False])
@pytest.mark.parametrize("hpc", [None, "hpc_ckpt_1.ckpt", "hpc_ckpt_12.ckpt"])
def test_a_restart_never_leaves_the_choice_to_lightnings_own_hpc_resume(tmp_path, monkeypatch, srun, hpc):
    """A restart goes on as --ckpt_path last, whether or not Lightning's fit, given no ckpt_path, would resume from an
    hpc checkpoint by itself (asked of Lightning's own checkpoint connector): that choice is by the number in the
    file's name, not by how far training went. hpc_checkpoints finds what Lightning would take. A job's first attempt
    goes on as --ckpt_path last only where Lightning would resume it from an hpc checkpoint: a new job given an
    earlier job's run folder."""
    for name, value in srun_task().items():
        monkeypatch.setenv(name, value)
    if not srun:  # in the batch script itself, not started by srun
        monkeypatch.delenv("SLURM_NTASKS")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.ckpt").write_bytes(b"")
    if hpc:
        (tmp_path / hpc).write_bytes(b"")
    trainer = Trainer(accelerator="cpu", devices=1, default_root_dir=str(tmp_path), logger=False)
    lightning = trainer._checkpoint_connector._parse_ckpt_path(
        TrainerFn.FITTING, None, model_provided=True, model_connected=True
    )
    assert lightning == (str(tmp_path / hpc) if hpc and srun else None)
    assert bool(hpc_checkpoints(str(tmp_path))) == (lightning is not None)
    config = _config(tmp_path)
    assert continue_slurm_restart("fit", config) and config.ckpt_path == "last"
    monkeypatch.delenv("SLURM_RESTART_COUNT")
    config = _config(tmp_path)
    assert continue_slurm_restart("fit", config) == (lightning is not None)
    assert config.ckpt_path == ("last" if lightning else None)


def test_only_a_restarted_fit_without_a_checkpoint_path_changes(tmp_path, monkeypatch):
    for name, value in srun_task().items():
        monkeypatch.setenv(name, value)
    config = _config(tmp_path)
    assert not continue_slurm_restart("fit", config) and config.ckpt_path is None  # the job's first attempt
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    assert not continue_slurm_restart("fit", config) and config.ckpt_path is None
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    for subcommand in ("validate", "test", "predict"):
        assert not continue_slurm_restart(subcommand, config) and config.ckpt_path is None
    named = _config(tmp_path, ckpt_path="runs/x/epoch3.ckpt")
    assert not continue_slurm_restart("fit", named) and named.ckpt_path == "runs/x/epoch3.ckpt"
    assert continue_slurm_restart("fit", config) and config.ckpt_path == "last"
