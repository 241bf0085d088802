"""Run folders hold what happened, no more (issue 37): a refused command leaves the runs/ tree as it was (no empty or
half-filled version_N pushing the next run to a later number; an earlier run it was to continue untouched), a fit
warns of a non-empty checkpoint folder only where another run's checkpoints are in it, and an evaluation requeued by
SLURM leaves no hpc_ckpt_N.ckpt behind (it resumes its outcomes, not a checkpoint)."""

import json
import os
import shutil
import signal
import warnings
from pathlib import Path

import pytest
import yaml
from lightning import Callback

from helpers import eval_config, fake_slurm_job, tiny_config, untrained_checkpoint
from robust_lightning.cli import main
from robust_lightning.errors import UserError

NOT_EMPTY = "exists and is not empty"


def _tree(root: Path) -> list[str] | None:
    """Every path under ``root`` (None: no root)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else None


def _fit_warnings(args: list[str]) -> tuple[int, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code = main(args)
    return code, [str(w.message) for w in caught]


# ------------------------------------------------------------------------------------- refused commands
@pytest.mark.parametrize("refusal", ["data_module", "missing_init_from", "init_from", "incompatible_checkpoint"])
def test_a_refused_first_command_leaves_no_runs_tree(tmp_path, refusal, capsys):
    """Refused after the logger made runs/tiny/version_0 (and, for the model's refusals, config.yaml, the lock and the
    markers in it): nothing of it stays, runs/ included, which the command made."""
    config = tiny_config(tmp_path)
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_text("not a checkpoint")
    command = {
        "data_module": ["fit", "--config", str(config), "--data.holdout", "1000"],
        "missing_init_from": ["fit", "--config", str(config), "--model.init_from", str(tmp_path / "missing.ckpt")],
        "init_from": ["fit", "--config", str(config), "--model.init_from", str(garbage)],
        # a 10-class model where the config's data has 4 classes
        "incompatible_checkpoint": [
            "test",
            "--config",
            str(config),
            "--ckpt_path",
            str(untrained_checkpoint(tmp_path, "convnext_atto_convstem")),
        ],
    }[refusal]
    assert main(command) == 2
    assert "error:" in capsys.readouterr().err
    assert _tree(tmp_path / "runs") is None


def test_refusals_beside_an_earlier_run_leave_it_as_it_was(tmp_path, capsys):
    """A fixed checkpoint folder holding another run, a value the data module or the model refuses, with and without
    --ckpt_path last: the tree stays as it was (the run they were to continue keeps every file; no copy of its log
    is left), and the next fit takes the number the refused ones had."""
    checkpoints = tmp_path / "runs" / "tiny" / "checkpoints"
    config = tiny_config(
        tmp_path, **{"checkpoint.dirpath": str(checkpoints), "checkpoint.enable_version_counter": False}
    )
    fit = ["fit", "--config", str(config)]
    assert main(fit) == 0
    before = _tree(tmp_path / "runs")
    assert "tiny/version_0/results.json" in before and "tiny/checkpoints/last.ckpt" in before
    refusals = [
        (fit, "holds the checkpoints of the run in"),
        ([*fit, "--data.holdout", "1000"], "data.holdout"),
        ([*fit, "--ckpt_path", "last", "--trainer.max_epochs", "2", "--data.holdout", "1000"], "data.holdout"),
        ([*fit, "--ckpt_path", "last", "--trainer.max_epochs", "2", "--model.attack_eps", "-1"], "attack_eps"),
    ]
    for command, message in refusals:
        capsys.readouterr()
        assert main(command) == 2, command
        assert message in capsys.readouterr().err
        assert _tree(tmp_path / "runs") == before, command
    # the run continues; a new one, with checkpoints of its own, takes version_1
    assert main([*fit, "--ckpt_path", "last", "--trainer.max_epochs", "2"]) == 0
    assert json.loads((tmp_path / "runs" / "tiny" / "version_0" / "results.json").read_text())["fit"]["epochs"] == 2
    assert main([*fit, "--checkpoint.dirpath", str(tmp_path / "other")]) == 0
    assert sorted(p.name for p in (tmp_path / "runs" / "tiny").glob("version_*")) == ["version_0", "version_1"]


class FailAfterBatch(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        raise UserError("a failure after the run began")


def test_a_run_that_failed_after_it_began_keeps_its_folder(tmp_path, capsys):
    """Not a refusal: a fit that ran batches and then stopped with an error keeps what it wrote."""
    config = tiny_config(tmp_path, **{"trainer.callbacks": [{"class_path": "test_run_folders.FailAfterBatch"}]})
    assert main(["fit", "--config", str(config)]) == 2
    assert "a failure after the run began" in capsys.readouterr().err
    run = tmp_path / "runs" / "tiny" / "version_0"
    assert (run / "config.yaml").is_file() and (run / ".fit").is_file()


# ------------------------------------------------------------------------ the non-empty checkpoint folder
def test_lightnings_non_empty_warning_only_where_another_runs_checkpoints_are(tmp_path, caplog, capsys):
    """A fresh fit into a fixed checkpoint folder (its own lock and owner marker in it) and its resume (its own
    checkpoints in it) get no warning; the resume says whose the checkpoints are. A fresh fit that starts over in a
    run directory holding an earlier attempt's checkpoints keeps Lightning's warning."""
    checkpoints = tmp_path / "ckpts"
    fixed = tiny_config(tmp_path, **{"checkpoint.dirpath": str(checkpoints)})
    code, caught = _fit_warnings(["fit", "--config", str(fixed)])
    assert code == 0 and (checkpoints / "last.ckpt").is_file()
    assert not [m for m in caught if NOT_EMPTY in m], caught
    assert NOT_EMPTY not in "".join(capsys.readouterr())
    caplog.clear()
    with caplog.at_level("INFO"):
        code, caught = _fit_warnings(
            ["fit", "--config", str(fixed), "--ckpt_path", "last", "--trainer.max_epochs", "2"]
        )
    assert code == 0 and not [m for m in caught if NOT_EMPTY in m], caught
    assert NOT_EMPTY not in "".join(capsys.readouterr()) + caplog.text
    assert f"checkpoint directory {checkpoints}: this run's checkpoints" in caplog.text

    earlier = tmp_path / "again" / "runs" / "tiny" / "version_0" / "checkpoints"  # an earlier attempt's
    earlier.mkdir(parents=True)
    shutil.copyfile(checkpoints / "last.ckpt", earlier / "last.ckpt")
    again = tiny_config(tmp_path / "again")
    code, caught = _fit_warnings(["fit", "--config", str(again), "--trainer.logger.init_args.version", "0"])
    assert code == 0 and [m for m in caught if NOT_EMPTY in m], caught


# ------------------------------------------------------------------------------ an evaluation's requeue
class SignalAtTestBatch(Callback):
    """Sends signal ``signal_name`` to this process at the end of test batch ``batch``."""

    def __init__(self, batch: int, signal_name: str = "SIGUSR1"):
        self.batch, self.signum = batch, signal.Signals[signal_name]

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
        if batch_idx == self.batch:
            os.kill(os.getpid(), self.signum)


def test_an_evaluation_requeued_by_slurm_resumes_its_outcomes_and_leaves_no_hpc_checkpoint(
    tmp_path, autoattack_checkpoint, monkeypatch, caplog, capsys
):
    """SLURM's requeue signal in an AutoAttack evaluation: the evaluation stops at the end of the batch it came in,
    its outcomes kept, and the job is requeued (scontrol) without an hpc checkpoint; the requeued job runs the command
    again, resumes the outcomes and completes. No hpc_ckpt_N.ckpt anywhere, and the requeue signal's handler is given
    back."""
    ckpt, synthetic_root = autoattack_checkpoint
    for name, value in fake_slurm_job(tmp_path).items():
        monkeypatch.setenv(name, value)
    config = eval_config(tmp_path, synthetic_root)
    signalled = yaml.safe_load(config.read_text())
    signalled["trainer"]["callbacks"] += [
        {"class_path": "test_run_folders.SignalAtTestBatch", "init_args": {"batch": 0}}
    ]
    (tmp_path / "signalled.yaml").write_text(yaml.safe_dump(signalled))
    assert main(["test", "--config", str(tmp_path / "signalled.yaml"), "--ckpt_path", str(ckpt)]) == 143
    # the last word: SLURM runs the requeued job again, nothing for the user to run
    assert "test stopped for SLURM's requeue (exit status 143); the requeued job runs it again" in (
        capsys.readouterr().err
    )
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
    assert not list(tmp_path.rglob("hpc_ckpt_*"))

    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    caplog.clear()
    with caplog.at_level("INFO"):
        assert main(["test", "--config", str(config), "--ckpt_path", str(ckpt)]) == 0  # the requeued job
    assert "Linf-4_255: resuming, 6 images already done" in caplog.text  # the batch of 6 the signal came in
    assert not list(tmp_path.rglob("hpc_ckpt_*"))
    (results,) = (tmp_path / "runs" / "aa").glob("version_*/results.json")
    assert json.loads(results.read_text())["autoattack"]["threat_models"]["Linf-4_255"]["num_points"] == 20


def test_a_command_stopped_by_sigterm_in_a_slurm_job_says_that_a_requeue_resumes_it_by_itself(
    tmp_path, autoattack_checkpoint, monkeypatch, capsys
):
    """SIGTERM without the requeue signal before it (SLURM pre-empting a job): SLURM may requeue the job, whose
    restart resumes by itself, so the advice to run the command again says so."""
    ckpt, synthetic_root = autoattack_checkpoint
    for name, value in fake_slurm_job(tmp_path).items():
        monkeypatch.setenv(name, value)
    config = yaml.safe_load(eval_config(tmp_path, synthetic_root).read_text())
    config["trainer"]["callbacks"] += [
        {"class_path": "test_run_folders.SignalAtTestBatch", "init_args": {"batch": 0, "signal_name": "SIGTERM"}}
    ]
    (tmp_path / "signalled.yaml").write_text(yaml.safe_dump(config))
    assert main(["test", "--config", str(tmp_path / "signalled.yaml"), "--ckpt_path", str(ckpt)]) == 143
    err = capsys.readouterr().err
    assert "test interrupted by SIGTERM (exit status 143); the same command resumes it" in err
    assert "if SLURM requeues this job, as it does a pre-empted job submitted with --requeue" in err
    assert not (tmp_path / "scontrol.log").exists()


def test_autoattack_outcomes_never_land_in_the_working_directorys_root(tmp_path, autoattack_checkpoint, monkeypatch):
    """A config without trainer.default_root_dir or results_dir (Lightning's default: the working directory, often
    a repository checkout): the outcomes go to runs/autoattack there, not ./autoattack."""
    ckpt, synthetic_root = autoattack_checkpoint
    config = yaml.safe_load(eval_config(tmp_path, synthetic_root).read_text())
    del config["trainer"]["default_root_dir"]
    del config["trainer"]["callbacks"][0]["init_args"]["results_dir"]
    (tmp_path / "bare.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    assert main(["test", "--config", str(tmp_path / "bare.yaml"), "--ckpt_path", str(ckpt)]) == 0
    assert not (tmp_path / "autoattack").exists()
    assert list((tmp_path / "runs" / "autoattack").glob("*/rank0.jsonl"))
    # the command's results.json holds the checks; the reference's raise none on this plain classifier
    (results,) = (tmp_path / "runs" / "aa").glob("version_*/results.json")
    (section,) = json.loads(results.read_text())["autoattack"]["threat_models"].values()
    reference = {"randomized", "range_output", "dynamic", "n_classes", "square_sr"}  # no DLR attack: no zero_gradients
    sanity = {"eps_monotonic", "unbounded", "iterative_vs_one_step", "engines_agree"}
    assert set(section["checks"]) == reference | sanity
    assert not any(section["checks"][name]["raised"] for name in reference)
