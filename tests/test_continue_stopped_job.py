"""Continuing a stopped SLURM job, as docs/clusters.md ("Continuing a stopped job") says: a job that ended without a
requeue (its time limit, ``scancel``, a node failure) continues with the same sbatch, ``RUN_DIR`` set to the stopped
job's run folder and ``--ckpt_path last``; a job that SLURM restarts continues by itself. Either way the fit resumes
from the run's checkpoint furthest in training, whatever its kind (robust_lightning.training.run_directory.
resume_checkpoint), so no step is trained twice, and it ends with the weights of the run left alone, bit for bit.

Each job is slurm/train_multinode.sbatch itself, run as SLURM runs a batch script on its node: bash, in the
environment of a one-task job (helpers.fake_slurm_job, whose scontrol records the requeue), with an srun that starts
the one task. Each stop is real: SLURM's requeue signal, SIGTERM, or SIGKILL, which the fit sends itself inside a
step (slurm_cluster.SignalMidStep). The fits run with a user's defaults, the progress display and a loader worker
(one, not data.num_workers' 8: the tiny dataset has 8 batches)."""

import csv
import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from helpers import REPO, fake_slurm_job, run_command, tiny_config, trainer_args
from robust_lightning.cli import main
from robust_lightning.loggers import WANDB_RUN_FILE
from test_log_continuity import offline_runs, wandb_env
from test_wandb import OfflineRun

TEMPLATE = REPO / "slurm" / "train_multinode.sbatch"
STEPS = 8  # 2 epochs of 4 steps
JOB = "4242"  # fake_slurm_job's job id; the job's RUN_DIR is runs/slurm/requeue-test-4242
RUN = Path("runs/slurm/requeue-test-4242")  # relative to the job's working directory, as the template makes it
NEW_JOB = "5151"  # the job that continues a stopped one


def node(tmp_path: Path) -> dict[str, str]:
    """SLURM's environment for the batch script of a one-node, one-task job, with the job's scontrol and srun."""
    env = fake_slurm_job(tmp_path)
    srun = tmp_path / "bin" / "srun"
    # one task: the command itself, srun's options (--kill-on-bad-exit) left out
    srun.write_text('#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nexec "$@"\n')
    srun.chmod(0o755)
    return {**env, "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS_PER_NODE": "1", "PYTHON": sys.executable}


def sbatch(tmp_path: Path, env: dict[str, str], *args: str, status: int = 0, **variables: str) -> str:
    """The template's batch script in ``tmp_path``, as SLURM runs it: ``args`` go to `fit`, ``variables`` to the
    environment (RUN_DIR, SLURM_JOB_ID, SLURM_RESTART_COUNT, ...). Returns its output."""
    launcher = tmp_path / "batch_script.py"  # run_command runs Python: it hands over to bash, in its session
    launcher.write_text("import os, sys\nos.execvp('bash', ['bash', *sys.argv[1:]])\n")
    result = run_command([str(TEMPLATE), *args], cwd=tmp_path, timeout=240, env={**env, **variables}, script=launcher)
    output = result.stdout + result.stderr
    assert result.returncode == status, output[-4000:]
    return output


def config(tmp_path: Path, **extra) -> dict[str, str]:
    """The job's environment with CONFIG: a tiny fit of 2 epochs of 4 steps."""
    path = tiny_config(
        tmp_path,
        **{
            "trainer.max_epochs": 2,
            "trainer.limit_train_batches": STEPS // 2,
            "trainer.log_every_n_steps": 1,
            "trainer.enable_progress_bar": True,
            "data.batch_size": 2,
            "data.num_workers": 1,
            "data.source.init_args.train_per_class": 4,
            "model.arch": "test_resnet",
            **extra,
        },
    )
    return {**node(tmp_path), "CONFIG": str(path)}


def callbacks(record: Path, stop: tuple[int, str] | None = None) -> list[str]:
    """--trainer.callbacks: record each trained step (slurm_cluster.Pace) and, with ``stop``, send the signal
    inside that step."""
    chosen = [{"class_path": "slurm_cluster.Pace", "init_args": {"record": str(record), "seconds": 0}}]
    if stop is not None:
        step, name = stop
        chosen.append({"class_path": "slurm_cluster.SignalMidStep", "init_args": {"step": step, "signal_name": name}})
    return ["--trainer.callbacks", json.dumps(chosen)]


def trained(record: Path) -> list[int]:
    return [json.loads(line)["step"] for line in record.read_text().splitlines()]


def step_of(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=True)["global_step"]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    saved = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert saved["global_step"] == STEPS
    return saved["state_dict"]


@pytest.fixture(scope="module")
def alone(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The final weights of the run left alone: the same job, never stopped."""
    tmp_path = tmp_path_factory.mktemp("alone")
    sbatch(tmp_path, config(tmp_path))
    return weights(tmp_path / RUN)


def assert_continued(run_dir: Path, alone: dict[str, torch.Tensor], *records: Path) -> None:
    """The attempts trained steps 1 to STEPS once each, the run's log and results.json hold every step once, and the
    weights are those of the run left alone, bit for bit."""
    assert [step for record in records for step in trained(record)] == list(range(1, STEPS + 1))
    with open(run_dir / "metrics.csv") as f:
        logged = Counter(int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss"))
    assert logged == Counter(range(STEPS))  # metrics.csv numbers steps from 0
    fit = json.loads((run_dir / "results.json").read_text())["fit"]
    assert (fit["epochs"], fit["steps"]) == (2, STEPS) and "interrupted" not in fit
    got = weights(run_dir)
    assert got.keys() == alone.keys()
    for name, value in alone.items():
        assert torch.equal(got[name], value), name


def test_a_sigterm_stop_after_a_requeue_continues_from_its_last_ckpt(tmp_path, alone):
    """Attempt 1 is requeued in step 2 (hpc_ckpt_1.ckpt of step 2). Attempt 2 resumes from it, and its time limit or
    an ``scancel`` ends it with SIGTERM in step 5, without a requeue: last.ckpt of step 5, newer by step than the hpc
    checkpoint that Lightning would take by itself. Both a new job with the old RUN_DIR and ``--ckpt_path last``
    and a restart by SLURM continue from last.ckpt."""
    env = config(tmp_path)
    first, second = tmp_path / "attempt1.jsonl", tmp_path / "attempt2.jsonl"
    sbatch(tmp_path, env, *callbacks(first, (2, "SIGUSR1")), status=143)
    assert (tmp_path / "scontrol.log").read_text() == f"requeue {JOB}\n"
    output = sbatch(tmp_path, env, *callbacks(second, (5, "SIGTERM")), status=143, SLURM_RESTART_COUNT="1")
    run_dir, hpc, last = tmp_path / RUN, RUN / "hpc_ckpt_1.ckpt", RUN / "checkpoints" / "last.ckpt"
    assert f"--ckpt_path last: resuming from {hpc}, the newest intact checkpoint by training step (step 2" in output
    assert (step_of(tmp_path / hpc), step_of(tmp_path / last)) == (2, 5)
    stopped = tmp_path / "stopped"
    shutil.copytree(run_dir, stopped)  # the run as the stop left it, file times kept, for the second way on

    third = tmp_path / "attempt3.jsonl"
    output = sbatch(tmp_path, env, *callbacks(third), "--ckpt_path", "last", RUN_DIR=str(RUN), SLURM_JOB_ID=NEW_JOB)
    assert f"run dir {RUN}" in output
    assert f"--ckpt_path last: resuming from {last}, the newest intact checkpoint by training step (step 5" in output
    assert f"Restoring states from the checkpoint path at {last}" in output
    assert_continued(run_dir, alone, first, second, third)

    shutil.rmtree(run_dir)
    shutil.copytree(stopped, run_dir)
    restarted = tmp_path / "restarted.jsonl"
    output = sbatch(tmp_path, env, *callbacks(restarted), SLURM_RESTART_COUNT="2")
    assert "SLURM restarted this job (2 restarts so far): the fit goes on as --ckpt_path last" in output
    assert f"--ckpt_path last: resuming from {last}, the newest intact checkpoint by training step (step 5" in output
    assert f"Restoring states from the checkpoint path at {last}" in output
    assert_continued(run_dir, alone, first, second, restarted)


def test_a_requeued_job_cancelled_before_it_ran_continues_from_its_hpc_checkpoint(tmp_path, alone):
    """The job is requeued in step 6, after epoch 0's last.ckpt (step 4), and the requeued job is cancelled before
    it starts. A new job with the old RUN_DIR and ``--ckpt_path last`` resumes from hpc_ckpt_1.ckpt (step 6), not
    from last.ckpt, and continues the run's CSV log, results.json and W&B run (the id RUN_DIR/wandb_run.json keeps),
    though its job id differs."""
    env = {**config(tmp_path), **wandb_env(tmp_path), "WANDB_PROJECT": "rl"}
    first, second = tmp_path / "attempt1.jsonl", tmp_path / "attempt2.jsonl"
    sbatch(tmp_path, env, *callbacks(first, (6, "SIGUSR1")), status=143)
    run_dir, hpc, last = tmp_path / RUN, RUN / "hpc_ckpt_1.ckpt", RUN / "checkpoints" / "last.ckpt"
    assert (step_of(tmp_path / hpc), step_of(tmp_path / last)) == (6, 4)
    kept = (run_dir / "metrics.csv").read_text()

    output = sbatch(tmp_path, env, *callbacks(second), "--ckpt_path", "last", RUN_DIR=str(RUN), SLURM_JOB_ID=NEW_JOB)
    assert f"--ckpt_path last: resuming from {hpc}, the newest intact checkpoint by training step (step 6" in output
    assert f"Restoring states from the checkpoint path at {hpc}" in output
    assert (run_dir / "metrics.csv").read_text().startswith(kept)
    assert_continued(run_dir, alone, first, second)
    run_id = json.loads((run_dir / WANDB_RUN_FILE).read_text())["id"]
    attempts = [OfflineRun(folder) for folder in offline_runs(run_dir / "wandb")]
    assert [attempt.run.run_id for attempt in attempts] == [run_id, run_id]
    history = [row["trainer/global_step"] for attempt in attempts for row in attempt.history if "train/loss" in row]
    assert history == list(range(STEPS))


STEP_CHECKPOINTS = {
    "checkpoint.every_n_train_steps": 2,
    "checkpoint.monitor": None,
    "checkpoint.save_top_k": -1,
    "checkpoint.filename": "step{step:03d}",
}


def test_a_node_failure_continues_from_the_newest_step_checkpoint(tmp_path, alone):
    """A checkpoint every 2 steps, and the node fails (SIGKILL) in step 7: step006.ckpt and last.ckpt hold step 6,
    last.ckpt saved after it. A new job with the old RUN_DIR and ``--ckpt_path last`` trains steps 7 and 8 only."""
    env = config(tmp_path, **STEP_CHECKPOINTS)
    first, second = tmp_path / "attempt1.jsonl", tmp_path / "attempt2.jsonl"
    sbatch(tmp_path, env, *callbacks(first, (7, "SIGKILL")), status=128 + 9)  # bash's status for its killed task
    run_dir, last = tmp_path / RUN, RUN / "checkpoints" / "last.ckpt"
    steps = {path.name: step_of(path) for path in (run_dir / "checkpoints").glob("*.ckpt")}
    assert steps == {"step002.ckpt": 2, "step004.ckpt": 4, "step006.ckpt": 6, "last.ckpt": 6}

    output = sbatch(tmp_path, env, *callbacks(second), "--ckpt_path", "last", RUN_DIR=str(RUN), SLURM_JOB_ID=NEW_JOB)
    assert (
        f"--ckpt_path last: resuming from {last}, the newest intact checkpoint by training step (step 6, the highest "
        "of its 4 checkpoints; of those at that step, the one saved last)"
    ) in output
    assert_continued(run_dir, alone, first, second)


def test_a_damaged_newest_checkpoint_is_passed_over_with_a_note(tmp_path, alone):
    """As above, and the restart is SLURM's (a job submitted with --requeue is requeued after a node failure), but
    last.ckpt was damaged (cut short, as a copy or a full disk can leave it): the restart resumes from step006.ckpt,
    of the same step, and says that it passed last.ckpt over."""
    env = config(tmp_path, **STEP_CHECKPOINTS)
    first, second = tmp_path / "attempt1.jsonl", tmp_path / "attempt2.jsonl"
    sbatch(tmp_path, env, *callbacks(first, (7, "SIGKILL")), status=128 + 9)
    last = tmp_path / RUN / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:4096])

    output = sbatch(tmp_path, env, *callbacks(second), SLURM_RESTART_COUNT="1")
    step6 = RUN / "checkpoints" / "step006.ckpt"
    assert f"--ckpt_path last: resuming from {step6}, the newest intact checkpoint by training step (step 6" in output
    assert "last.ckpt is damaged (RuntimeError: PytorchStreamReader failed reading zip archive" in output
    assert_continued(tmp_path / RUN, alone, first, second)


def test_a_run_whose_only_checkpoint_is_a_damaged_hpc_one_is_refused(tmp_path, monkeypatch, capsys):
    """Under SLURM, a fit given no ckpt_path resumes from an hpc checkpoint by itself (Lightning), damaged or not. So
    where --ckpt_path last finds nothing to resume from but such a file, the command is refused with one line saying
    what to do, before any Trainer is made, and leaves the run folder as it was."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "hpc_ckpt_1.ckpt").write_bytes(b"PK\x03\x04 cut short")
    for name, value in fake_slurm_job(tmp_path).items():
        monkeypatch.setenv(name, value)
    path = tiny_config(tmp_path)
    template = {  # what slurm/train_multinode.sbatch gives the fit
        "trainer.default_root_dir": run_dir,
        "checkpoint.dirpath": run_dir / "checkpoints",
        "trainer.logger": json.dumps(
            {
                "class_path": "robust_lightning.loggers.CSVLogger",
                "init_args": {"save_dir": str(run_dir), "name": "", "version": ""},
            }
        ),
        "ckpt_path": "last",
    }
    assert main(trainer_args("fit", path, template)) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith(
        f"robust-lightning: error: --ckpt_path last: no checkpoint of this run to resume from in {run_dir}"
    )
    assert "hpc_ckpt_1.ckpt is damaged" in error
    assert f"Lightning would resume from {run_dir}'s hpc_ckpt_N.ckpt by itself: move those files away" in error
    assert sorted(p.name for p in run_dir.rglob("*")) == ["checkpoints", "hpc_ckpt_1.ckpt"]
