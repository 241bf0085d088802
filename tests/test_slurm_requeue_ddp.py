"""What a cluster runs (issues 37 and 44): slurm/train_multinode.sbatch submitted as a user does, a 2-task DDP fit
(gloo, CPU, a loader worker per task, W&B offline), requeued by SLURM's requeue signal in the middle of its first
validation, the selection attack's. The requeued job validates that epoch again and ends with the weights of the same
fit left alone, bit for bit, its metrics.csv rows (every step once, the first attempt's rows kept) and one W&B run
whose two attempts' records hold every row once, in order, and one log of both attempts. On the real single-node cluster
of tests/test_slurm.py; the whole test runs under a hard time limit, after which its jobs are cancelled and it fails
(the cluster fixture then stops the daemons)."""

import csv
import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from robust_lightning.data.synthetic import ensure_synthetic_dataset
from robust_lightning.loggers import WANDB_RUN_FILE
from slurm_cluster import FINISHED
from test_slurm import TESTS, cluster, submit_training  # noqa: F401 - cluster: the cluster's fixture
from test_wandb import OfflineRun

pytestmark = pytest.mark.slurm

TIME_LIMIT = 420  # seconds for the whole test, both jobs and SLURM's requeue included
EPOCHS, STEPS_PER_EPOCH = 2, 8  # 32 training images in global batches of 4 (2 per task)
SYNTHETIC = {
    "num_classes": 4,
    "train_per_class": 8,
    "val_per_class": 2,
    "image_size": 32,
    "samples_per_shard": 4,  # 8 training shards: several per task and loader worker; a validation shard per task
}


def fit_config(directory: Path, data: Path, record: Path, hold_at: dict | None) -> Path:
    """A tiny APGD-AT fit with EMA, a robust selection at each validation, a checkpoint every 3 steps, and
    slurm_cluster.Pace recording each trained step (SLURM attempt, global step) and, with ``hold_at``, each validation
    batch, holding the first attempt's tasks at ``hold_at`` until the test's signal has reached them; the same
    computation whatever ``hold_at``."""
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "strategy": "ddp",
            "max_epochs": EPOCHS,
            "num_sanity_val_steps": 0,
            "log_every_n_steps": 1,
            "enable_model_summary": False,
            "callbacks": [
                {
                    "class_path": "slurm_cluster.Pace",
                    "init_args": {"record": str(record), "seconds": 0, "hold_at": hold_at},
                }
            ],
        },
        "model": {
            "arch": "test_resnet",
            "warmup_epochs": 0.5,
            "attack": "apgd",
            "attack_steps": 1,
            "ema_decay": 0.9,
            "select_attack_steps": 1,
        },
        "data": {
            "source": {"class_path": "SyntheticSource", "init_args": {**SYNTHETIC, "root": str(data)}},
            "image_size": 32,
            "global_batch_size": 4,
            "num_workers": 1,
        },
        "checkpoint": {"every_n_train_steps": 3, "monitor": None},
    }
    path = directory / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def records_of(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()] if record.is_file() else []


def steps_of(record: Path) -> list[tuple[int, int]]:
    """(attempt, global step) of each trained step, from Pace's record."""
    return [(r["attempt"], r["step"]) for r in records_of(record) if "step" in r]


def read_log(run_dir: Path) -> list[dict]:
    text = (run_dir / "metrics.csv").read_text()
    assert text.splitlines().count(text.splitlines()[0]) == 1  # one header
    return list(csv.DictReader(text.splitlines()))


@pytest.fixture(scope="module")
def requeued(cluster, tmp_path_factory):  # noqa: F811 - the fixture imported above
    """Both jobs submitted together; the second gets SLURM's requeue signal in its first validation, is requeued, and
    its second attempt is let start at once. Returns what the tests read. Everything within TIME_LIMIT: past it, or on
    any failure, both jobs are cancelled and the test fails."""
    tmp_path = tmp_path_factory.mktemp("requeue")
    deadline = time.time() + TIME_LIMIT

    def left() -> float:
        return max(1.0, deadline - time.time())

    data = tmp_path / "synthetic"
    ensure_synthetic_dataset(data, **SYNTHETIC)  # once, before both jobs read it
    alone_dir, requeued_dir = tmp_path / "alone", tmp_path / "requeued"
    env = {
        "SLURM_CONF": str(cluster.conf),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        # W&B as docs/clusters.md says: WANDB_PROJECT adds the logger, offline on the compute node
        "WANDB_PROJECT": "slurm-requeue",
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_API_KEY": "",
    }
    jobs = []
    try:
        # the requeued job's signal lands at the start of its first validation's first batch
        for directory, hold_at in ((alone_dir, None), (requeued_dir, {"validation": 0})):
            directory.mkdir()
            wandb_dirs = {f"WANDB_{kind}_DIR": str(directory / f"wandb-{kind.lower()}") for kind in ("CONFIG", "CACHE")}
            # the template's defaults: RUN_DIR and the log named after the job, in the submission directory
            config = fit_config(directory, data, directory / "steps.jsonl", hold_at)
            jobs.append(submit_training(cluster, config, None, tasks=2, cwd=directory, env={**env, **wandb_dirs}))
        alone, job = jobs
        name = cluster.job(job)["JobName"]  # the template's #SBATCH --job-name
        run_dir = Path("runs") / "slurm" / f"{name}-{job}"  # RUN_DIR, relative to the submission directory
        out = requeued_dir / f"slurm-{name}-{job}.out"

        def log_tail() -> str:
            return out.read_text()[-3000:] if out.is_file() else str(cluster.job(job))

        while not any("validation" in r for r in records_of(requeued_dir / "steps.jsonl")):
            assert cluster.job(job).get("JobState") in ("PENDING", "RUNNING"), log_tail()
            assert time.time() < deadline, f"no validation within {TIME_LIMIT} s:\n{log_tail()}"
            time.sleep(0.2)
        # what SLURM sends 90 s before the time limit with #SBATCH --signal=SIGUSR1@90
        cluster.run("scancel", "--signal=USR1", job)
        while (now := cluster.job(job)).get("Restarts") != "1" or now.get("JobState") != "PENDING":
            ended = now.get("Restarts") == "0" and now.get("JobState") in FINISHED  # Pace's hold failed it, say
            assert time.time() < deadline and not ended, f"not requeued: {now}\n{log_tail()}"
            time.sleep(0.5)
        first_rows = read_log(requeued_dir / run_dir)  # the first attempt's log, as it left it
        first_records = records_of(requeued_dir / "steps.jsonl")
        # SLURM holds a requeued batch job for about two minutes (BeginTime); let it start now
        cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now")
        final = cluster.wait(job, timeout=left())[0]
        reference = cluster.wait(alone, timeout=left())[0]
    finally:  # past the time limit, or any failure: no job is left running (the fixture stops the cluster after)
        for started in jobs:
            cluster.run("scancel", "--full", started, check=False)
    assert final["JobState"] == "COMPLETED" and final["Restarts"] == "1", out.read_text()[-3000:]
    alone_out = alone_dir / f"slurm-{name}-{alone}.out"
    assert reference["JobState"] == "COMPLETED" and reference["Restarts"] == "0", alone_out.read_text()[-3000:]
    return SimpleNamespace(
        job=job,
        log=out.read_text(),  # both attempts (open-mode=append)
        relative_run_dir=run_dir,
        run_dir=requeued_dir / run_dir,
        alone_run_dir=alone_dir / "runs" / "slurm" / f"{name}-{alone}",
        steps=steps_of(requeued_dir / "steps.jsonl"),
        alone_steps=steps_of(alone_dir / "steps.jsonl"),
        first_rows=first_rows,
        first_records=first_records,
    )


def without_times(rows: list[dict]) -> list[dict]:
    """metrics.csv's rows without the throughput's (times) and empty cells."""
    kept = [{k: v for k, v in row.items() if v and not k.startswith("perf/")} for row in rows]
    return [row for row in kept if set(row) - {"step", "epoch"}]


def signature(row: dict) -> tuple:
    """A W&B history row's step and metrics, the throughput's (times) and W&B's own aside."""
    return row.get("trainer/global_step"), sorted(k for k in row if not k.startswith(("_", "perf/", "trainer/")))


def attempts(steps: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
    return [s for attempt, s in steps if attempt == 0], [s for attempt, s in steps if attempt == 1]


def test_a_requeued_two_task_ddp_job_ends_as_the_fit_left_alone(requeued):
    log, run_dir = requeued.log, requeued.run_dir
    assert f"job {requeued.job}, attempt 1: 1 node(s) x 2 task(s)" in log
    assert f"job {requeued.job}, attempt 2: 1 node(s) x 2 task(s)" in log
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in log and "distributed_backend=gloo" in log
    assert log.count("Requeued SLURM job: ") == 1  # by the training processes alone, not by a loader worker
    # the requeued attempt goes on as --ckpt_path last, from the requeue's checkpoint: the newest by training step
    assert "SLURM restarted this job (1 restarts so far): the fit goes on as --ckpt_path last" in log
    assert f"Restored all states from the checkpoint at {requeued.relative_run_dir / 'hpc_ckpt_1.ckpt'}" in log

    # the first attempt stopped in its first validation, which it had not finished, with the checkpoint of that
    # validation's start; the second validated that epoch again and trained every later step once
    first, second = attempts(requeued.steps)
    assert [r["validation"] for r in requeued.first_records if "validation" in r] == [0], log[-3000:]
    resumed_at = torch.load(run_dir / "hpc_ckpt_1.ckpt", map_location="cpu", weights_only=True)["global_step"]
    assert first == list(range(1, STEPS_PER_EPOCH + 1)) and resumed_at == STEPS_PER_EPOCH, log[-3000:]
    assert second == list(range(STEPS_PER_EPOCH + 1, EPOCHS * STEPS_PER_EPOCH + 1))
    assert [step for _, step in requeued.alone_steps] == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))

    # one metrics.csv: the first attempt's rows kept as they were, then the second's; each row of the fit left alone
    # once (the throughput's times aside), the cut validation's never
    rows = read_log(run_dir)
    assert [{k: v for k, v in row.items() if v} for row in rows[: len(requeued.first_rows)]] == [
        {k: v for k, v in row.items() if v} for row in requeued.first_rows
    ]
    assert not any(row.get("val/acc1") for row in requeued.first_rows)
    assert without_times(rows) == without_times(read_log(requeued.alone_run_dir))
    assert sorted(int(row["epoch"]) for row in rows if row.get("val/acc1")) == list(range(EPOCHS))

    # one W&B run: the id the run directory keeps names both attempts' offline folders; the second continues the
    # first's history (_step), and together they hold the rows of the fit left alone, in order
    run_id = json.loads((run_dir / WANDB_RUN_FILE).read_text())["id"]
    folders = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert [(folder.name.rsplit("-", 1)[1], [p.name for p in folder.glob("run-*.wandb")]) for folder in folders] == [
        (run_id, [f"run-{run_id}.wandb"])
    ] * 2
    first_run, second_run = (OfflineRun(folder) for folder in folders)
    assert second_run.run.run_id == run_id
    history = first_run.history + second_run.history
    assert [row["_step"] for row in history] == list(range(len(history)))
    alone_history = OfflineRun(next((requeued.alone_run_dir / "wandb").glob("offline-run-*"))).history
    assert [signature(row) for row in history if signature(row)[1]] == [
        signature(row) for row in alone_history if signature(row)[1]
    ]

    # the final weights of the requeued job are those of the fit left alone, bit for bit
    expected, got = (
        torch.load(d / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        for d in (requeued.alone_run_dir, run_dir)
    )
    assert got["global_step"] == expected["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert expected["state_dict"].keys() == got["state_dict"].keys()
    assert any(key.startswith("ema.") for key in got["state_dict"])
    for key, value in expected["state_dict"].items():
        assert torch.equal(got["state_dict"][key], value), key
    fit = json.loads((run_dir / "results.json").read_text())["fit"]
    assert fit["steps"] == EPOCHS * STEPS_PER_EPOCH and fit["epochs"] == EPOCHS
    assert fit["conditions"]["world_size"] == 2


def test_the_first_attempts_wandb_records_are_in_its_offline_run(requeued):
    """The first attempt finished its W&B run before the requeue: SLURM's SIGTERM, which reaches every process of
    the job step, W&B's wandb-core included, comes after it wrote the attempt's records."""
    run_id = json.loads((requeued.run_dir / WANDB_RUN_FILE).read_text())["id"]
    first, _ = attempts(requeued.steps)
    first_run = OfflineRun(sorted((requeued.run_dir / "wandb").glob("offline-run-*"))[0])  # complete: an exit record
    assert first_run.run.run_id == run_id
    assert [row["trainer/global_step"] for row in first_run.history if "train/loss" in row] == [s - 1 for s in first]
    assert first_run.logged("val/acc1") == []  # the validation it was stopped in published nothing
    assert "Traceback" not in requeued.log and "Exception ignored" not in requeued.log
