"""How a 2-task DDP job of slurm/train_multinode.sbatch ends under srun's --kill-on-bad-exit, on the real single-node
cluster of tests/test_slurm.py (gloo, CPU, a loader worker per task):

- One task's error is the job's one error. The other task ends soon after, without a traceback, and the job fails.
- A stop by SIGTERM ends every task whole. Rank 0 writes results.json and says what happens next, here slowly, as on
  a busy shared filesystem, and no task exits 143 before it is done: srun would kill it after SLURM's KillWait.
  Rank 0 also ends its process slowly, as a busy machine does, until srun has signalled it once rank 1 has exited;
  it still exits 143 of itself."""

import atexit
import json
import os
import re
import time
from pathlib import Path

import pytest
import yaml
from lightning import Callback

from test_slurm import TESTS, cluster, submit_training  # noqa: F401 - cluster: the cluster's fixture

pytestmark = pytest.mark.slurm

TIME_LIMIT = 240  # seconds for a job, its start included
STOP_BOUND = 30  # seconds from a task's failure to the job's end
KILL_WAIT = 5  # the test cluster's KillWait: seconds from srun's SIGTERM to its SIGKILL


class SlowAtTheStop(Callback):
    """Rank 0 takes ``seconds`` over a stop before its results are written (the config's callbacks come first). At
    its process's exit, after the command has returned, it waits until srun has signalled the step."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def on_exception(self, trainer, pl_module, exception):
        if trainer.is_global_zero:
            atexit.register(until_srun_signals_the_step)
            time.sleep(self.seconds)


def until_srun_signals_the_step() -> None:
    """Waits until srun says in the job's log that it signals the step, at most 3 s, then 1 s more for the signal to
    arrive: less than KILL_WAIT in all, after which srun would kill the task."""
    environ = os.environ
    log = Path(environ["SLURM_SUBMIT_DIR"]) / f"slurm-{environ['SLURM_JOB_NAME']}-{environ['SLURM_JOB_ID']}.out"
    deadline = time.monotonic() + 3
    while "Terminating" not in log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1)


def fit_config(directory: Path, callbacks: list[dict]) -> Path:
    """A tiny 2-task fit: 64 training images in global batches of 16, so 4 steps, with a user's defaults (the
    progress display, a loader worker per task)."""
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "strategy": "ddp",
            "max_epochs": 1,
            "num_sanity_val_steps": 0,
            "enable_model_summary": False,
            "callbacks": callbacks,
        },
        "model": {"arch": "test_resnet", "warmup_epochs": 0.5},
        "data": {
            "source": {
                "class_path": "SyntheticSource",
                "init_args": {
                    "num_classes": 4,
                    "train_per_class": 16,
                    "val_per_class": 2,
                    "image_size": 32,
                    "samples_per_shard": 8,
                    "root": str(directory / "synthetic"),
                },
            },
            "image_size": 32,
            "batch_size": 8,
            "num_workers": 1,
        },
    }
    path = directory / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run_job(cluster, directory: Path, callbacks: list[dict], while_running=None) -> tuple[dict, str, Path, float]:  # noqa: F811
    """The template submitted as a user does; ``while_running(job)`` once it runs. Returns the job's record, its log,
    its RUN_DIR and when it ended. Past TIME_LIMIT the job is cancelled and the test fails."""
    env = {"SLURM_CONF": str(cluster.conf), "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    job = submit_training(cluster, fit_config(directory, callbacks), None, tasks=2, cwd=directory, env=env)
    try:
        if while_running is not None:
            while_running(job)
        record = cluster.wait(job, timeout=TIME_LIMIT)[0]
        ended = time.time()
    finally:
        cluster.run("scancel", "--full", job, check=False)
    name = record["JobName"]
    log = (directory / f"slurm-{name}-{job}.out").read_text()
    return record, log, directory / "runs" / "slurm" / f"{name}-{job}", ended


def test_one_task_s_error_is_the_job_s_one_error(cluster, tmp_path):  # noqa: F811
    record_file = tmp_path / "failed_at"
    failing = {"class_path": "test_job_errors.FailsOnOneRank", "init_args": {"rank": 1, "record": str(record_file)}}
    record, log, _, ended = run_job(cluster, tmp_path, [failing])
    assert record["JobState"] == "FAILED", log[-3000:]
    assert ended - float(record_file.read_text()) < STOP_BOUND, log[-3000:]
    ours = [line for line in log.splitlines() if line.startswith("robust-lightning")]
    assert ours == [
        "robust-lightning: error: (rank 1) a file only rank 1 reads is corrupt",
        "robust-lightning: rank 0 stopped: rank 1 failed (see its message above)",
    ] or ours == ["robust-lightning: error: (rank 1) a file only rank 1 reads is corrupt"], log[-3000:]
    assert "Traceback" not in log and "c10d" not in log and "Connection closed" not in log, log[-3000:]
    assert [line for line in log.splitlines() if "gloo" in line.lower()] == ["distributed_backend=gloo"], log


def test_a_stop_by_sigterm_ends_every_task_whole(cluster, tmp_path):  # noqa: F811
    steps = tmp_path / "steps.jsonl"
    # both tasks hold at step 2 until the signal has reached them: the fit stops there, mid-epoch
    pace = {
        "class_path": "slurm_cluster.Pace",
        "init_args": {"record": str(steps), "seconds": 0, "hold_at": {"step": 2}},
    }
    slow = {"class_path": f"{__name__}.SlowAtTheStop", "init_args": {"seconds": KILL_WAIT + 3}}

    def stop_after_two_steps(job: str) -> None:
        deadline = time.time() + TIME_LIMIT
        while not steps.is_file() or len(steps.read_text().splitlines()) < 2:
            assert cluster.job(job).get("JobState") in ("PENDING", "RUNNING"), cluster.job(job)
            assert time.time() < deadline, "no 2 steps trained"
            time.sleep(0.2)
        cluster.run("scancel", "--signal=TERM", job)  # every task of the step: a pre-emption, a time limit

    record, log, run_dir, _ = run_job(cluster, tmp_path, [pace, slow], while_running=stop_after_two_steps)
    assert record["ExitCode"].startswith("143:") or record["JobState"] == "FAILED", record
    stop = json.loads(steps.read_text().splitlines()[-1])["step"]
    assert stop == 2, log[-3000:]
    assert f"fit interrupted by SIGTERM at epoch 0, step {stop}" in log, log[-3000:]
    assert "interrupted by SIGTERM (exit status 143)" in log, log[-3000:]
    fit = json.loads((run_dir / "results.json").read_text())["fit"]
    assert fit["interrupted"] == "SIGTERM" and fit["steps"] == stop
    # srun saw rank 1 exit first and signalled the step, after rank 0's work was done; it ended neither task: both
    # exit 143 of themselves
    exits = sorted(re.findall(r"tasks? ([0-9-]+): Exited with exit code (\d+)", log))
    assert exits == [("0", "143"), ("1", "143")], log[-3000:]
    assert "Terminating" in log, log[-3000:]
    assert log.index("interrupted by SIGTERM (exit status 143)") < log.index("Terminating"), log[-3000:]
