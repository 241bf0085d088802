"""A training stopped wherever the signal lands goes on to the numbers of the same training left alone (issue 44).

One 2-rank DDP fit (gloo on the CPU) with a user's defaults: the progress display, a loader worker per rank, W&B
logging offline, the end-of-fit AutoAttack evaluation. It is stopped three times by SIGTERM to every process of the
job, W&B's service process included, as a scheduler stops a job: in the checkpoint's save at the end of the first
epoch's validation, in the middle of the second epoch's validation (the selection attack included), and in the
end-of-fit AutoAttack. The first stop gets a second SIGTERM to every process while rank zero ends its W&B run, as
SLURM sends one after a requeue and srun once a task has exited. Each attempt exits 143 without a traceback, and the
next one continues with the documented command (``--ckpt_path last``). The last attempt ends with the weights of
the fit left alone bit for bit, its metrics.csv rows, its results.json numbers, and one W&B run whose record files
hold every row once, in order, with the history's ``_step`` continuous across the attempts. Each command runs under
a hard time limit that kills every process it started.

The last test stops a one-process fit inside the spectrum that HessianSpectrum computes at an epoch's end (the
analysis runs in one process only), and compares it with the same fit left alone."""

import csv
import json
from pathlib import Path

import pytest
import torch
import yaml

from helpers import run_command, two_epoch_fit
from robust_lightning.data.synthetic import ensure_synthetic_dataset
from robust_lightning.loggers import WANDB_RUN_FILE
from robust_lightning.wandb_records import history_rows, read_records, run_record_files

SYNTHETIC = {"num_classes": 4, "train_per_class": 8, "val_per_class": 4, "image_size": 32, "samples_per_shard": 4}
EPOCHS, STEPS_PER_EPOCH = 2, 4  # 32 training images in global batches of 8
# where the stops land, in the order they come: the save at the first validation's end (acted on after the next
# step), the second batch of the second epoch's validation, after the AutoAttack's first batch at the fit's end
STOPS = ["save:0", "validation:1:1", "autoattack:1"]
TIME_LIMIT = 240  # seconds per command


def fit_config(directory: Path, data: Path, marks: Path | None) -> Path:
    """The fit, with the stop points armed where ``marks`` is given (None: the fit left alone)."""
    stop_options = {"marks": str(marks)} if marks else {}
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "strategy": "ddp",
            "max_epochs": EPOCHS,
            "num_sanity_val_steps": 0,
            "log_every_n_steps": 1,
            "default_root_dir": str(directory / "runs"),
            "logger": [
                {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs", "name": "fit"}},
                {
                    "class_path": "robust_lightning.loggers.WandbLogger",
                    "init_args": {"project": "stops", "save_dir": "runs"},
                },
            ],
            "callbacks": [
                {"class_path": "stop_points.StopAt", "init_args": {"points": STOPS, **stop_options}},
                {"class_path": "stop_points.SignalAgainAtTheEnd", "init_args": stop_options},
                {
                    "class_path": "stop_points.AutoAttackStoppedAt",
                    "init_args": {
                        "after": 1,
                        **stop_options,
                        "fit_images": 16,
                        "threat_models": [{"norm": "Linf", "eps": 4 / 255}],
                        "version": "apgd-ce",
                        "n_iter": 5,
                    },
                },
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
            "global_batch_size": 8,
            "eval_batch_size": 4,
            "num_workers": 1,
        },
    }
    path = directory / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def wandb_env(directory: Path) -> dict[str, str]:
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_DISABLE_GIT": "true",
        "WANDB_API_KEY": "",
        "WANDB_CONFIG_DIR": str(directory / "wandb-config"),
        "WANDB_CACHE_DIR": str(directory / "wandb-cache"),
        "OMP_NUM_THREADS": "1",
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The fit left alone, and the fit stopped at each of STOPS and continued each time: their run folders and the
    stopped fit's attempts (exit status and output)."""
    root = tmp_path_factory.mktemp("stops")
    data = root / "synthetic"
    ensure_synthetic_dataset(data, **SYNTHETIC)
    alone, stopped = root / "alone", root / "stopped"
    for directory in (alone, stopped):
        directory.mkdir()
    left_alone = run_command(
        ["fit", "--config", str(fit_config(alone, data, None))], cwd=alone, timeout=TIME_LIMIT, env=wandb_env(alone)
    )
    assert left_alone.returncode == 0, left_alone.stderr[-3000:]
    config = fit_config(stopped, data, stopped / "marks")
    attempts = []
    for attempt in range(len(STOPS) + 1):
        args = ["fit", "--config", str(config), *(["--ckpt_path", "last"] if attempt else [])]
        attempts.append(run_command(args, cwd=stopped, timeout=TIME_LIMIT, env=wandb_env(stopped)))
        (stopped / f"attempt{attempt}.log").write_text(attempts[-1].stdout + "\n=====\n" + attempts[-1].stderr)
        if attempts[-1].returncode != 143:
            break
    return alone / "runs" / "fit" / "version_0", stopped / "runs" / "fit" / "version_0", attempts


def rows_of(run: Path) -> list[dict[str, str]]:
    """metrics.csv's rows, without the throughput's (times) and empty cells."""
    with open(run / "metrics.csv", newline="") as file:
        rows = [{k: v for k, v in row.items() if v and not k.startswith("perf/")} for row in csv.DictReader(file)]
    return [row for row in rows if set(row) - {"step", "epoch"}]


def test_every_stop_exits_143_without_a_traceback_and_the_last_attempt_finishes(runs):
    _, stopped, attempts = runs
    assert [a.returncode for a in attempts] == [143] * len(STOPS) + [0], attempts[-1].stderr[-3000:]
    # every stop point fired, and the second SIGTERM at the end of the first stop, which came at the step after the
    # save (each mark holds the global step it fired at)
    marks = stopped.parents[2] / "marks"
    assert sorted(mark.name for mark in marks.iterdir()) == sorted([*STOPS, "again"])
    assert (marks / "again").read_text() == str(STEPS_PER_EPOCH + 1)
    for attempt in attempts:
        output = attempt.stdout + attempt.stderr
        assert "Traceback" not in output and "Exception ignored" not in output, output[-3000:]
    for attempt in attempts[:-1]:
        assert "interrupted by SIGTERM (exit status 143); the same command resumes it" in attempt.stderr
    said = [attempt.stdout + attempt.stderr for attempt in attempts]
    # the first stop came in a save, and was acted on at the end of the next training step
    assert f"fit interrupted by SIGTERM at epoch 1, step {STEPS_PER_EPOCH + 1}" in said[0]
    # the second in the second epoch's validation: its checkpoint is of the last step, before that validation
    assert f"fit interrupted by SIGTERM at epoch 1, step {EPOCHS * STEPS_PER_EPOCH}" in said[1]
    # the third in the end-of-fit evaluation, which the last attempt resumes
    assert "fit interrupted by SIGTERM at epoch 2" in said[2] and "AutoAttack Linf-4_255: resuming" in said[3]


def test_the_stopped_fit_ends_with_the_weights_logs_and_results_of_the_fit_left_alone(runs):
    alone, stopped, _ = runs
    expected, got = (torch.load(run / "checkpoints" / "last.ckpt", weights_only=True) for run in (alone, stopped))
    assert got["global_step"] == expected["global_step"] == EPOCHS * STEPS_PER_EPOCH
    assert expected["state_dict"].keys() == got["state_dict"].keys()
    assert any(key.startswith("ema.") for key in got["state_dict"])
    for key, value in expected["state_dict"].items():
        assert torch.equal(got["state_dict"][key], value), key
    # every row once, the validation of the stopped second epoch among them, the training accuracies of each epoch
    # over the whole epoch however many attempts trained it
    assert rows_of(stopped) == rows_of(alone)
    assert sum("val/select_acc" in row for row in rows_of(stopped)) == EPOCHS
    results = [json.loads((run / "results.json").read_text()) for run in (alone, stopped)]
    for section in results:  # what each attempt's own session did (its times, its fp32 checks) is its own
        for threat in section["autoattack"]["threat_models"].values():
            threat.pop("seconds_this_session")
            threat.pop("claims_refuted_in_fp32_this_session")
    assert results[1]["autoattack"]["threat_models"] == results[0]["autoattack"]["threat_models"]
    assert results[1]["fit"]["metrics"] == results[0]["fit"]["metrics"]


def test_one_wandb_run_holds_every_row_once_in_order(runs):
    """The W&B service process died with each stop, losing what it had not written; each attempt sends W&B the
    rows of metrics.csv that the earlier attempts' records lack, and continues their history's _step."""
    alone, stopped, attempts = runs

    def history(run: Path) -> list[dict]:
        run_id = json.loads((run / WANDB_RUN_FILE).read_text())["id"]
        files = run_record_files(run.parents[1] / "wandb", run_id)
        assert files
        rows = []
        for path in sorted(
            files,
            key=lambda p: next((r.run.start_time.ToNanoseconds() for r in read_records(p) if r.HasField("run")), 0),
        ):
            rows += history_rows(read_records(path))
        return rows

    got, expected = history(stopped), history(alone)
    assert len(
        run_record_files(stopped.parents[1] / "wandb", json.loads((stopped / WANDB_RUN_FILE).read_text())["id"])
    ) == len(attempts)
    assert [row["_step"] for row in got] == list(range(len(got)))  # continuous across the attempts

    def signature(row: dict) -> tuple:
        return row.get("trainer/global_step"), sorted(k for k in row if not k.startswith(("_", "perf/")))

    kept = [signature(row) for row in got if any(not k.startswith(("_", "perf/", "trainer/")) for k in row)]
    wanted = [signature(row) for row in expected if any(not k.startswith(("_", "perf/", "trainer/")) for k in row)]
    assert kept == wanted
    assert any("the earlier attempts did not record" in a.stdout + a.stderr for a in attempts[1:])


def test_a_fit_stopped_inside_the_hessian_spectrum_resumes_to_the_fit_left_alone(tmp_path):
    """SIGTERM to the job between two minibatches of the first epoch's spectrum: the fit stops at once (exit 143),
    before another step changes the weights, and its checkpoint keeps the epoch's images. The resumed fit
    (``--ckpt_path last``) computes that spectrum first and ends with the weights, the spectra of both epochs and
    the logged Hessian figures of the fit left alone."""
    spectra, weights, logged = {}, {}, {}

    def stopped_in_the_spectrum(done, run: Path) -> None:
        saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
        assert saved["global_step"] == 2  # the first epoch's two steps, none after the spectrum
        [state] = [v for k, v in saved["callbacks"].items() if k.startswith("HessianSpectrumStoppedAt")]
        assert state["pending"]["epoch"] == 0 and len(state["pending"]["images"]) == 8

    for name in ("alone", "stopped"):
        marks = {"marks": str(tmp_path / name / "marks")} if name == "stopped" else {}
        callback = {
            "class_path": "stop_points.HessianSpectrumStoppedAt",
            "init_args": {"top_k": 2, "max_iter": 4, "max_images": 8, "batch_size": 4, **marks},
        }
        stopped = stopped_in_the_spectrum if name == "stopped" else None
        run = two_epoch_fit(tmp_path / name, callback, stopped, **{"trainer.limit_val_batches": 1})
        section = json.loads((run / "results.json").read_text())["hessian"]
        section["conditions"].pop("checkpoint")  # the resumed fit names the checkpoint it resumed from
        assert Path(section.pop("plot")) == run / "hessian.png"
        spectra[name] = section
        weights[name] = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        rows = [row for path in sorted(run.glob("metrics*.csv")) for row in csv.DictReader(path.open())]
        logged[name] = sorted((row["step"], row["hessian/nep"]) for row in rows if row.get("hessian/nep"))
    assert set(spectra["alone"]["epochs"]) == {"0", "1"}
    assert spectra["stopped"] == spectra["alone"]
    assert weights["stopped"].keys() == weights["alone"].keys()
    assert all(torch.equal(weights["stopped"][k], weights["alone"][k]) for k in weights["alone"])
    assert len(logged["alone"]) == 2 and logged["stopped"] == logged["alone"]
