"""One training, one log, however many attempts it takes (issue 37): metrics.csv keeps every earlier attempt's rows
and gains the later ones (a row of a step trained again appears once per attempt that trained it), the rows up to a
checkpoint are on disk with it, and every attempt logs to the same W&B run, whose id the run directory keeps. Each
attempt is a command run as users run it (``python -m robust_lightning``); W&B offline, read back from its files."""

import csv
import json
from collections import Counter
from pathlib import Path

import pytest

from helpers import REPO, fake_slurm_job, run_command, tiny_config
from robust_lightning.loggers import WANDB_RUN_FILE, use_project_loggers
from robust_lightning.wandb_records import read_records
from test_wandb import OfflineRun

WANDB_YAML = str(REPO / "configs" / "loggers" / "wandb.yaml")
STEPS_PER_EPOCH = 4
DELETED = "will be deleted"  # Lightning's CSVLogger's warning, which the project's logger never gives


def wandb_env(tmp_path: Path) -> dict:
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "WANDB_API_KEY": "",
    }


def pace(record: Path) -> dict:
    """Records each trained step (slurm_cluster.Pace: attempt, epoch, global step) without slowing it."""
    return {"class_path": "slurm_cluster.Pace", "init_args": {"record": str(record), "seconds": 0}}


def signal_at(step: int, name: str) -> dict:
    """The signal ``name`` to the fit itself inside the training step that makes optimiser step ``step``."""
    return {"class_path": "slurm_cluster.SignalMidStep", "init_args": {"step": step, "signal_name": name}}


def config(tmp_path: Path, **extra) -> Path:
    return tiny_config(
        tmp_path,
        **{
            "trainer.max_epochs": 2,
            "trainer.limit_train_batches": STEPS_PER_EPOCH,
            "trainer.log_every_n_steps": 1,
            "data.batch_size": 2,
            "data.source.init_args.train_per_class": 4,
            "model.arch": "test_resnet",
            **extra,
        },
    )


def fit(tmp_path: Path, *args: str, env: dict | None = None, status: int = 0) -> str:
    result = run_command(["fit", *args], cwd=tmp_path, timeout=240, env={**wandb_env(tmp_path), **(env or {})})
    output = result.stdout + result.stderr
    assert result.returncode == status, output[-3000:]
    assert DELETED not in output, output[-3000:]
    return output


def trained(record: Path) -> list[int]:
    """The global steps an attempt trained (Pace's record), as metrics.csv numbers them (global step - 1)."""
    return [json.loads(line)["step"] - 1 for line in record.read_text().splitlines()]


def read_log(run_dir: Path) -> tuple[list[str], list[dict]]:
    """metrics.csv: one header (no second one further down) and rows that all have its columns."""
    text = (run_dir / "metrics.csv").read_text()
    lines = text.splitlines()
    assert lines.count(lines[0]) == 1 and text.endswith("\n")
    rows = list(csv.DictReader(text.splitlines()))
    assert all(None not in row and None not in row.values() for row in rows)  # no row longer or shorter
    return lines[0].split(","), rows


def steps_with(rows: list[dict], key: str) -> Counter:
    return Counter(int(row["step"]) for row in rows if row.get(key))


def offline_runs(wandb_dir: Path) -> list[Path]:
    return sorted(wandb_dir.glob("offline-run-*"))  # by start time: each attempt's folder


def test_sigterm_then_ckpt_path_last_continues_the_csv_and_the_wandb_run(tmp_path):
    """The documented pair (CSV + W&B, configs/loggers/wandb.yaml). Attempt 1 stops at step 3 on SIGTERM (last.ckpt
    there), before any validation; attempt 2 (--ckpt_path last) trains the rest and adds the validation columns."""
    first, second = tmp_path / "attempt1.jsonl", tmp_path / "attempt2.jsonl"
    path = config(tmp_path, **{"trainer.callbacks": [pace(first), signal_at(3, "SIGTERM")]})
    fit(tmp_path, "--config", str(path), "--config", WANDB_YAML, status=143)
    run_dir = tmp_path / "runs" / "tiny" / "version_0"
    kept = (run_dir / "metrics.csv").read_text()
    before = list(csv.DictReader(kept.splitlines()))
    assert trained(first) == [0, 1, 2] and steps_with(before, "train/loss") == Counter([0, 1, 2])  # the stop step too

    output = fit(
        tmp_path,
        "--config",
        str(path),
        "--config",
        WANDB_YAML,
        "--ckpt_path",
        "last",
        "--trainer.callbacks",
        json.dumps([pace(second)]),
    )
    assert "continuing the log of the earlier attempts" in output
    assert trained(second) == list(range(3, 2 * STEPS_PER_EPOCH))
    header, rows = read_log(run_dir)
    assert "val/acc1" in header and "val/acc1" not in kept.splitlines()[0]  # a column only attempt 2 logged
    # attempt 1's rows, rewritten under the wider header, then attempt 2's: each step once (none trained twice)
    assert steps_with(rows, "train/loss") == Counter(trained(first) + trained(second))
    assert [{k: v for k, v in row.items() if v} for row in rows[: len(before)]] == [
        {k: v for k, v in row.items() if v} for row in before
    ]
    assert sorted(int(row["epoch"]) for row in rows if row.get("val/acc1")) == [0, 1]

    # one W&B run: the id the run directory keeps, in both attempts' offline folders, its history continuous
    run_id = json.loads((run_dir / WANDB_RUN_FILE).read_text())["id"]
    attempts = [OfflineRun(folder) for folder in offline_runs(tmp_path / "runs" / "wandb")]
    assert [attempt.run.run_id for attempt in attempts] == [run_id, run_id]
    logged = [row["trainer/global_step"] for attempt in attempts for row in attempt.history if "train/loss" in row]
    assert logged == list(range(2 * STEPS_PER_EPOCH))
    assert all(attempt.metrics["val/select_acc"].summary.max for attempt in attempts)  # best, in each attempt


def test_a_slurm_requeue_keeps_every_attempts_rows_and_one_wandb_run(tmp_path):
    """The template's loggers (slurm/train_multinode.sbatch: the project's, writing into RUN_DIR itself). SLURM's
    requeue signal at step 6 writes hpc_ckpt_1.ckpt and the attempt stops there (exit 143; SLURM would end it).
    The requeued attempt resumes from the hpc checkpoint on its own, as under SLURM, and trains steps 7 and 8 and
    epoch 1's validation: metrics.csv holds every step once, the first attempt's rows first, and the one W&B run
    holds both attempts' histories (the first attempt's finished before the requeue)."""
    run_dir = tmp_path / "runs"
    csv_logger = {"save_dir": str(run_dir), "name": "", "version": ""}
    wandb_logger = {"save_dir": str(run_dir), "project": "rl", "name": "requeue-test-4242"}
    loggers = [
        {"class_path": "robust_lightning.loggers.CSVLogger", "init_args": csv_logger},
        {"class_path": "robust_lightning.loggers.WandbLogger", "init_args": wandb_logger},
    ]
    slurm = fake_slurm_job(tmp_path)
    first, second = tmp_path / "attempt1.jsonl", tmp_path / "attempt2.jsonl"
    path = config(tmp_path, **{"trainer.logger": loggers, "checkpoint.dirpath": str(run_dir / "checkpoints")})
    callbacks = json.dumps([pace(first), signal_at(6, "SIGUSR1")])
    fit(tmp_path, "--config", str(path), "--trainer.callbacks", callbacks, env=slurm, status=143)
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n" and (run_dir / "hpc_ckpt_1.ckpt").is_file()
    kept = (run_dir / "metrics.csv").read_text()

    # the requeued job: the same command, the same RUN_DIR (SLURM_JOB_ID dropped: no second requeue is asked for)
    slurm.pop("SLURM_JOB_ID")
    output = fit(tmp_path, "--config", str(path), "--trainer.callbacks", json.dumps([pace(second)]), env=slurm)
    assert f"Restored all states from the checkpoint at {run_dir / 'hpc_ckpt_1.ckpt'}" in output
    assert trained(first) == list(range(6)) and trained(second) == [6, 7]
    text = (run_dir / "metrics.csv").read_text()
    assert text.startswith(kept)  # the first attempt's log, whole, then the second's rows
    _, rows = read_log(run_dir)
    assert steps_with(rows, "train/loss") == Counter(range(2 * STEPS_PER_EPOCH))
    assert sorted(int(row["epoch"]) for row in rows if row.get("val/acc1")) == [0, 1]

    run_id = json.loads((run_dir / WANDB_RUN_FILE).read_text())["id"]
    folders = offline_runs(run_dir / "wandb")
    attempts = [OfflineRun(folder) for folder in folders]
    assert [attempt.run.run_id for attempt in attempts] == [run_id, run_id]
    logged = [row["trainer/global_step"] for attempt in attempts for row in attempt.history if "train/loss" in row]
    assert logged == trained(first) + trained(second)
    # the summary keeps the best selection score of both attempts, though the second validated epoch 1 only
    scores = [row["val/select_acc"] for attempt in attempts for row in attempt.history if "val/select_acc" in row]
    summaries = [
        json.loads(item.value_json)
        for record in read_records(next(folders[1].glob("run-*.wandb")))
        if record.WhichOneof("record_type") == "summary"
        for item in record.summary.update
        if list(item.nested_key or [item.key]) == ["val/select_acc"]
    ]
    assert len(scores) == 2 and summaries[-1] == {"max": max(scores)}
    assert json.loads((run_dir / WANDB_RUN_FILE).read_text())["best"]["val/select_acc"] == max(scores)


def test_kill_9_loses_only_rows_of_steps_trained_again(tmp_path):
    """A checkpoint every 2 steps; the fit is killed with SIGKILL inside step 4. The log keeps every row written
    before the kill (those of steps 1 to 3, on disk with step 2's checkpoint or after it); the resumed attempt
    (from step 2) trains step 3 again and appends its rows: step 3's row once per attempt that trained it."""
    first, second = tmp_path / "attempt1.jsonl", tmp_path / "attempt2.jsonl"
    path = config(
        tmp_path,
        **{
            "trainer.callbacks": [pace(first), signal_at(4, "SIGKILL")],
            "checkpoint.monitor": None,  # a step checkpoint before any validation
            "checkpoint.every_n_train_steps": 2,
            "checkpoint.save_top_k": -1,
            "checkpoint.filename": "step{step:03d}",
        },
    )
    fit(tmp_path, "--config", str(path), status=-9)
    run_dir = tmp_path / "runs" / "tiny" / "version_0"
    assert [p.name for p in sorted((run_dir / "checkpoints").glob("*.ckpt"))] == ["last.ckpt", "step002.ckpt"]
    _, before = read_log(run_dir)
    assert trained(first) == [0, 1, 2] and steps_with(before, "train/loss") == Counter([0, 1, 2])

    fit(tmp_path, "--config", str(path), "--ckpt_path", "last", "--trainer.callbacks", json.dumps([pace(second)]))
    assert trained(second) == list(range(2, 2 * STEPS_PER_EPOCH))
    _, rows = read_log(run_dir)
    assert rows[: len(before)] == [{**{key: "" for key in rows[0]}, **row} for row in before]
    assert steps_with(rows, "train/loss") == Counter(trained(first) + trained(second))  # step 3: twice


def test_a_resumed_wandb_run_keeps_the_best_score_of_the_earlier_attempts(tmp_path, monkeypatch):
    """W&B's max summary of a resumed run counts only the values logged since the resume: the logger puts the
    best of every attempt (kept in the run directory) back into it. In this process, as tests/test_wandb.py does."""
    import wandb

    from robust_lightning.loggers import WandbLogger

    wandb.finish()
    wandb.teardown()  # wandb.setup() reads the environment once per process
    for name, value in wandb_env(tmp_path).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("WANDB_API_KEY")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / WANDB_RUN_FILE).write_text(json.dumps({"id": "earlier1", "best": {"val/select_acc": 0.75}}))
    try:
        logger = WandbLogger(save_dir=str(tmp_path), project="rl")
        logger.keep_run_in(run_dir)
        logger.log_metrics({"val/select_acc": 0.5, "val/acc1": 0.5}, step=10)
    finally:
        wandb.finish()
        wandb.teardown()
    [folder] = offline_runs(tmp_path / "wandb")
    records = read_records(next(folder.glob("run-*.wandb")))
    assert next(r.run for r in records if r.WhichOneof("record_type") == "run").run_id == "earlier1"
    summaries = [
        (list(item.nested_key or [item.key]), json.loads(item.value_json))
        for record in records
        if record.WhichOneof("record_type") == "summary"
        for item in record.summary.update
    ]
    assert [value for key, value in summaries if key == ["val/select_acc"]][-1] == {"max": 0.75}
    state = json.loads((run_dir / WANDB_RUN_FILE).read_text())
    assert state == {"id": "earlier1", "best": {"val/select_acc": 0.75, "val/acc1": 0.5}}


def test_configs_naming_lightnings_loggers_get_the_projects():
    from jsonargparse import Namespace

    config = Namespace(
        trainer=Namespace(
            logger=[
                Namespace(class_path="lightning.pytorch.loggers.CSVLogger", init_args=Namespace(save_dir="runs")),
                Namespace(class_path="lightning.pytorch.loggers.wandb.WandbLogger", init_args=Namespace()),
                Namespace(class_path="lightning.pytorch.loggers.TensorBoardLogger", init_args=Namespace()),
            ]
        )
    )
    use_project_loggers(config)
    assert [logger.class_path for logger in config.trainer.logger] == [
        "robust_lightning.loggers.CSVLogger",
        "robust_lightning.loggers.WandbLogger",
        "lightning.pytorch.loggers.TensorBoardLogger",
    ]


@pytest.mark.parametrize("cut", [b"", b"0,0.5,1", b"epoch,lo"])
def test_a_row_cut_short_by_a_kill_is_dropped_before_the_log_continues(tmp_path, cut):
    from robust_lightning.loggers import CSVLogger

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    whole = b"epoch,loss,step\r\n0,1.5,0\r\n" if cut != b"epoch,lo" else b""
    (run_dir / "metrics.csv").write_bytes(whole + cut)
    logger = CSVLogger(tmp_path, name="", version="run")
    logger.log_metrics({"loss": 0.5, "acc": 0.25}, step=1)
    logger.save()
    header, rows = read_log(run_dir)
    if whole:  # the earlier rows kept under the wider header, then the new one
        assert header == ["acc", "epoch", "loss", "step"]
        assert rows == [
            {"acc": "", "epoch": "0", "loss": "1.5", "step": "0"},
            {"acc": "0.25", "epoch": "", "loss": "0.5", "step": "1"},
        ]
    else:  # not even a whole header: a new file
        assert header == ["acc", "loss", "step"] and rows == [{"acc": "0.25", "loss": "0.5", "step": "1"}]


def test_a_refused_fit_leaves_no_wandb_run_behind(tmp_path):
    """A fit with the CSV + W&B pair refused after its W&B run started (a value the data module rejects): no
    offline run, no wandb/ folder, no runs/ tree is left; the message is the refusal's. (tiny_config's bar off and
    no loader workers: the data module refuses the value in its set-up, before either would start.)"""
    run_dir = tmp_path / "runs"
    loggers = [
        {"class_path": f"robust_lightning.loggers.{name}", "init_args": {"save_dir": str(run_dir), **extra}}
        for name, extra in (("CSVLogger", {"name": "tiny"}), ("WandbLogger", {"project": "rl"}))
    ]
    path = config(tmp_path, **{"trainer.logger": loggers})
    output = fit(tmp_path, "--config", str(path), "--data.holdout", "1000", status=2)
    assert "data.holdout" in output and "Traceback" not in output
    assert not run_dir.exists(), sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob("*"))
