"""Preemption safety: checkpoints are written atomically, and a training run killed with SIGKILL mid-epoch
resumes with ``--ckpt_path last`` in its own run directory, with its selection and EMA state."""

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import REPO, fake_slurm_job, run_command, tiny_config, two_epoch_fit
from robust_lightning import cli
from robust_lightning.cli import main
from robust_lightning.loggers import CSVLogger
from robust_lightning.training.checkpoint_io import AtomicCheckpointIO, atomic_write_bytes

STEPS_PER_EPOCH = 12


def test_an_interrupted_write_leaves_the_previous_file_whole(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"step": 1}, target)

    real_fsync = os.fsync

    def killed_during_write(fd):  # the bytes are partly on disk when the "kill" lands
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", killed_during_write)
    with pytest.raises(KeyboardInterrupt):
        AtomicCheckpointIO().save_checkpoint({"step": 2, "weights": torch.zeros(1000)}, target)
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert torch.load(target, weights_only=True) == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["last.ckpt"]  # no partial file left behind
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"


def _fit(config: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "robust_lightning", "fit", "--config", str(config), *extra],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_kill_9_mid_epoch_then_ckpt_path_last_resumes_the_same_run(tmp_path):
    config = tiny_config(
        tmp_path,
        **{
            "trainer.max_epochs": 3,
            "trainer.limit_train_batches": STEPS_PER_EPOCH,
            "data.batch_size": 4,
            "data.source.init_args.train_per_class": STEPS_PER_EPOCH,
            "model.ema_decay": 0.9,
        },
    )
    run = tmp_path / "runs" / "tiny" / "version_0"
    last = run / "checkpoints" / "last.ckpt"
    process = _fit(config)
    deadline = time.time() + 240
    while not last.exists() and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert last.exists(), process.communicate()[0][-3000:]
    time.sleep(0.5)  # into the second epoch
    process.send_signal(signal.SIGKILL)
    process.wait()
    saved = torch.load(last, weights_only=True)  # whole and loadable, whenever the kill landed
    assert saved["global_step"] < 3 * STEPS_PER_EPOCH

    resumed = _fit(config, "--ckpt_path", "last")
    output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, output[-3000:]
    assert f"Restoring states from the checkpoint path at {last}" in output
    assert not (tmp_path / "runs" / "tiny" / "version_1").exists()  # the same run directory
    assert "val/acc1" in (run / "metrics.part1.csv").read_text()  # the killed run's log is kept, not overwritten
    fit = json.loads((run / "results.json").read_text())["fit"]
    assert fit["epochs"] == 3 and fit["steps"] == 3 * STEPS_PER_EPOCH
    final = torch.load(last, weights_only=True)
    # the selection state carried over: the best checkpoint is chosen among all epochs, the first included
    before = next(v for k, v in saved["callbacks"].items() if k.startswith("ModelCheckpoint"))
    after = next(v for k, v in final["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert before["best_model_path"] and float(after["best_model_score"]) >= float(before["best_model_score"])
    assert any(k.startswith("ema.") for k in final["state_dict"])  # EMA weights travel with the checkpoint


def test_sigterm_stops_a_fit_with_a_checkpoint_a_message_and_a_failing_status(tmp_path):
    """SIGTERM mid-epoch (a scheduler pre-empting the job): the fit stops at the next step, writes last.ckpt there
    and results.json marked interrupted, says how to resume and exits 143, not 0. The resume command it prints then
    finishes the run. The same under DDP, every rank stopping at the same step however the signals' arrival is
    spread over the ranks, is tests/test_preemption_ddp.py's first test."""
    record = tmp_path / "batches.jsonl"
    pace = {"class_path": "slurm_cluster.Pace", "init_args": {"record": str(record), "seconds": 0.3}}
    config = tiny_config(
        tmp_path,
        **{
            "trainer.max_epochs": 2,
            "trainer.limit_train_batches": STEPS_PER_EPOCH,
            "trainer.callbacks": [pace],
            "data.batch_size": 2,
            "data.source.init_args.train_per_class": STEPS_PER_EPOCH,
            # a user's defaults, which tiny_config turns off: the progress bar (here its line-per-N-steps form, as in a
            # SLURM log) and loader workers, whose processes get the signal too
            "trainer.enable_progress_bar": True,
            "data.num_workers": 1,
        },
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-m", "robust_lightning", "fit", "--config", str(config)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        deadline = time.time() + 240
        while (not record.exists() or len(record.read_text().splitlines()) < 3) and time.time() < deadline:
            assert process.poll() is None, process.communicate()[0][-3000:]
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGTERM)  # the whole job, as SLURM and schedulers signal every task
        output = process.communicate(timeout=120)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 143, output[-3000:]
    assert "fit interrupted by SIGTERM" in output and "--ckpt_path last" in output
    run = tmp_path / "runs" / "tiny" / "version_0"
    trained = len(record.read_text().splitlines())
    fit = json.loads((run / "results.json").read_text())["fit"]
    assert fit["interrupted"] == "SIGTERM" and 3 <= fit["steps"] <= trained < STEPS_PER_EPOCH  # within epoch 0
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == fit["steps"]
    resumed = subprocess.run(
        [sys.executable, "-m", "robust_lightning", "fit", "--config", str(config), "--ckpt_path", "last"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    fit = json.loads((run / "results.json").read_text())["fit"]
    assert fit["epochs"] == 2 and "interrupted" not in fit


@pytest.mark.parametrize("process_exits", [True, False])
def test_an_error_in_a_stops_save_is_reported_and_leaves_sigterm_ignored_where_the_process_exits(
    tmp_path, monkeypatch, capsys, process_exits
):
    """SIGTERM comes in a step, and the stop's checkpoint save fails (a full disk). The command reports the error
    in one line and exits 2. Where its process exits after it, SIGTERM stays ignored, as after a stop: the job is
    being stopped, and the scheduler's next SIGTERM would end the process before its exit. Called from Python
    (``main(args)``), it gives the earlier handler back. The fit runs in this process, where the handler can be
    read after the command; tiny_config's bar off and no loader workers, as the error comes in the save."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "register_at_fork", lambda **hook: None)  # keep this process's forks as they are
    callbacks = [
        {"class_path": "slurm_cluster.SignalMidStep", "init_args": {"step": 1, "signal_name": "SIGTERM"}},
        {"class_path": "stop_points.SaveFailsAfterASignal"},
    ]
    config = tiny_config(
        tmp_path, **{"model.arch": "test_resnet", "trainer.limit_train_batches": 2, "trainer.callbacks": callbacks}
    )
    before = signal.getsignal(signal.SIGTERM)
    try:
        code = main(["fit", "--config", str(config)], process_exits=process_exits)
        after = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, before)
    errors = capsys.readouterr().err
    assert code == 2 and "No space left on device" in errors and "Traceback" not in errors, errors
    assert after == (signal.SIG_IGN if process_exits else before)


def test_the_end_of_fit_evaluations_run_with_interrupted_system_calls_restarted(tmp_path, monkeypatch):
    """SIGTERM's handler restarts the system calls it interrupts (SA_RESTART) in the end-of-fit evaluations too
    (AutoAttack's and the Hessian spectrum's on_fit_end), whose collectives under DDP would otherwise fail on the
    rank the signal lands in. Lightning's teardown, which comes before them, puts the handlers back without it.
    In this process, where the flags can be read; tiny_config's bar off and no loader workers, which the handlers
    do not depend on."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "register_at_fork", lambda **hook: None)  # keep this process's forks as they are
    record = tmp_path / "restarts.json"
    callbacks = [{"class_path": "stop_points.RecordRestartFlags", "init_args": {"out": str(record)}}]
    overrides = {"model.arch": "test_resnet", "trainer.limit_train_batches": 1, "trainer.callbacks": callbacks}
    before = signal.getsignal(signal.SIGTERM)
    try:
        assert main(["fit", "--config", str(tiny_config(tmp_path, **overrides))], process_exits=False) == 0
    finally:
        signal.signal(signal.SIGTERM, before)
    assert json.loads(record.read_text()) == {"training": True, "fit end": True}


@pytest.mark.parametrize("process_exits", [True, False])
def test_a_finished_fit_notes_sigterm_until_its_end_and_then_ignores_it_where_the_process_exits(
    tmp_path, monkeypatch, process_exits
):
    """A fit that finished: SIGTERM is still noted (not fatal) while Lightning finalises its loggers, after the
    callbacks' teardown, and where the process exits after the command it is ignored while the command line ends
    the W&B run. A signal there would leave the W&B run unfinished, and a sweep's cell recorded as running. Called
    from Python (``main(args)``), the earlier handler is back by then, and it gets the SIGTERM noted while the
    loggers were finalised once main has ended the command: the command did not act on it. Before, the handlers
    were given back at the callbacks' teardown, and SIGTERM's default action was in place for both; later, the
    SIGTERM noted after the last batch was dropped. In this process, where the handlers can be read; tiny_config's
    bar off and no loader workers, which end before the moments checked."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "register_at_fork", lambda **hook: None)  # keep this process's forks as they are
    finalize, finish, seen = CSVLogger.finalize, cli.finish_wandb_run, {}

    def noting(what, call):
        return lambda *a, **k: (seen.setdefault(what, signal.getsignal(signal.SIGTERM)), call(*a, **k))[1]

    def signalled(*args, **kwargs):  # SIGTERM after the fit's last batch boundary
        seen.setdefault("finalize loggers", signal.getsignal(signal.SIGTERM))
        signal.raise_signal(signal.SIGTERM)
        return finalize(*args, **kwargs)

    monkeypatch.setattr(CSVLogger, "finalize", signalled)
    monkeypatch.setattr(cli, "finish_wandb_run", noting("finish W&B", finish))
    config = tiny_config(tmp_path, **{"model.arch": "test_resnet", "trainer.limit_train_batches": 1})
    received: list[int] = []

    def callers_handler(signum, frame):
        received.append(signum)

    before = signal.signal(signal.SIGTERM, callers_handler)
    try:
        assert main(["fit", "--config", str(config)], process_exits=process_exits) == 0
        after = signal.getsignal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, before)
    handler = seen["finalize loggers"]
    assert callable(handler) and handler is not callers_handler  # the command's
    assert seen["finish W&B"] == after == (signal.SIG_IGN if process_exits else callers_handler)
    assert received == ([] if process_exits else [signal.SIGTERM])


def test_the_slurm_requeue_signal_mid_step_checkpoints_at_the_end_of_that_step(tmp_path):
    """SLURM's requeue signal (SIGUSR1) lands in the middle of a training step. The hpc checkpoint is written at the
    end of that step (Lightning writes it inside the signal handler: half a step, whose batch the resumed run would
    train again), scontrol is asked to requeue the job once, the fit stops there (SLURM ends a requeued job at
    once; this test's scontrol does not) and the fit resumed from the checkpoint trains each remaining step exactly
    once."""
    record = tmp_path / "batches.jsonl"
    callbacks = [
        {"class_path": "slurm_cluster.Pace", "init_args": {"record": str(record), "seconds": 0}},
        {"class_path": "slurm_cluster.SignalMidStep", "init_args": {"step": 3}},
    ]
    # tiny_config's bar off and no loader workers: the step-end timing tested here does not depend on them;
    # tests/test_slurm.py signals a real SLURM job run with the progress display on and a loader worker
    config = tiny_config(
        tmp_path,
        **{
            "trainer.max_epochs": 1,
            "trainer.limit_train_batches": 6,
            "trainer.callbacks": callbacks,
            "data.batch_size": 2,
            "data.source.init_args.train_per_class": 6,
            "model.ema_decay": 0.9,
        },
    )
    env = {
        **os.environ,
        **fake_slurm_job(tmp_path),
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    first = subprocess.run(
        [sys.executable, "-m", "robust_lightning", "fit", "--config", str(config)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert first.returncode == 143, first.stderr[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    hpc = tmp_path / "runs" / "hpc_ckpt_1.ckpt"  # in trainer.default_root_dir (the templates': RUN_DIR)
    assert "fit stopped at epoch 0, step 3 for SLURM's requeue of the job" in first.stdout + first.stderr
    saved = torch.load(hpc, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 3  # the step the signal came in, finished
    progress = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    assert progress["ready"] == progress["started"] == progress["processed"] == 3 and progress["completed"] == 2

    record.unlink()
    env.pop("SLURM_JOB_ID")  # the resumed fit is not requeued again
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "robust_lightning",
            "fit",
            "--config",
            str(config),
            "--ckpt_path",
            str(hpc),
            "--trainer.callbacks",
            json.dumps(callbacks[:1]),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [json.loads(line)["step"] for line in record.read_text().splitlines()] == [4, 5, 6]


def test_a_requeue_replaces_the_checkpoint_of_the_previous_requeue(tmp_path):
    """Two requeues of one job, in steps 2 and 4 of its two attempts: the second writes hpc_ckpt_2.ckpt and removes
    hpc_ckpt_1.ckpt (a requeue a day would otherwise keep a copy of the run for each), and the checkpoints the
    run's policy keeps (here last.ckpt) stay."""
    record = tmp_path / "batches.jsonl"

    def attempt(step: int, restarts: int) -> subprocess.CompletedProcess:
        callbacks = [
            {"class_path": "slurm_cluster.Pace", "init_args": {"record": str(record), "seconds": 0}},
            {"class_path": "slurm_cluster.SignalMidStep", "init_args": {"step": step}},
        ]
        config = tiny_config(
            tmp_path,
            **{
                "trainer.max_epochs": 1,
                "trainer.limit_train_batches": 6,
                "trainer.callbacks": callbacks,
                "data.batch_size": 2,
                "data.source.init_args.train_per_class": 3,
                "model.arch": "test_resnet",
                "checkpoint.every_n_train_steps": 1,
            },
        )
        env = {**fake_slurm_job(tmp_path), "SLURM_RESTART_COUNT": str(restarts)}
        return run_command(["fit", "--config", str(config)], cwd=tmp_path, timeout=240, env=env)

    first = attempt(2, 0)
    assert first.returncode == 143, first.stderr[-3000:]
    (tmp_path / "bin").rename(tmp_path / "bin.first")  # fake_slurm_job makes its scontrol anew
    second = attempt(4, 1)
    assert second.returncode == 143, second.stderr[-3000:]
    hpc = sorted(p.name for p in (tmp_path / "runs").glob("hpc_ckpt_*.ckpt"))
    assert hpc == ["hpc_ckpt_2.ckpt"]
    assert torch.load(tmp_path / "runs" / "hpc_ckpt_2.ckpt", weights_only=True)["global_step"] == 4
    assert (tmp_path / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt").is_file()
    assert [json.loads(line)["step"] for line in record.read_text().splitlines()] == [1, 2, 3, 4]


def test_a_stop_in_an_epochs_last_step_without_validation_resumes_at_the_next_epoch_as_the_fit_left_alone(tmp_path):
    """SIGTERM in the last step of an epoch that no validation follows: the fit stops at the next epoch's start
    (a checkpoint written at the step's end would resume past the epoch's end). The resumed fit trains every step
    of that epoch and ends with the weights and the metrics.csv rows of the fit left alone."""
    weights, rows = {}, {}

    def stopped_at_the_epochs_start(done, run: Path) -> None:
        assert "fit interrupted by SIGTERM at epoch 1, step 2;" in done.stdout + done.stderr

    for name in ("alone", "stopped"):
        marks = {"marks": str(tmp_path / name / "marks")} if name == "stopped" else {}
        callback = {"class_path": "stop_points.StopAt", "init_args": {"points": ["step:1"], **marks}}
        stopped = stopped_at_the_epochs_start if name == "stopped" else None
        run = two_epoch_fit(tmp_path / name, callback, stopped, **{"trainer.limit_val_batches": 0})
        assert json.loads((run / "results.json").read_text())["fit"]["steps"] == 4
        weights[name] = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
        logged = sorted(run.glob("metrics*.csv"))  # the stopped run's first attempt is metrics.part1.csv
        rows[name] = sorted({line for path in logged for line in path.read_text().splitlines()[1:]})
    assert all(torch.equal(weights["stopped"][k], weights["alone"][k]) for k in weights["alone"])
    assert rows["stopped"] == rows["alone"] and len(rows["alone"]) == 2


def _ctrl_c_stopped_in_a_step(done, run: Path) -> None:
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    progress = saved["loops"]["fit_loop"]["epoch_loop.batch_progress"]["current"]
    # saved at the step's end, as a stop by SIGTERM: processed, to be counted completed on resume (Lightning's rule)
    assert (saved["global_step"], progress["ready"], progress["processed"]) == (1, 1, 1), progress
    assert "Ctrl-C: stopping at the next batch boundary (Ctrl-C again stops at once)" in done.stderr
    assert "fit interrupted by SIGINT (Ctrl-C) at epoch 0, step 1; checkpoint of this step:" in done.stderr
    last_line = done.stderr.strip().splitlines()[-1]
    assert last_line.startswith("robust-lightning: fit interrupted by Ctrl-C (exit status 130)")


def _ctrl_c_stopped_in_a_validation(done, run: Path) -> None:
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    progress = saved["loops"]["fit_loop"]["epoch_loop.val_loop.batch_progress"]["current"]
    assert (saved["global_step"], progress["ready"], progress["processed"]) == (2, 1, 0), progress


@pytest.mark.parametrize(
    "point, stopped",
    [("step:0", _ctrl_c_stopped_in_a_step), ("validation:0:1", _ctrl_c_stopped_in_a_validation)],
)
def test_ctrl_c_stops_at_the_next_batch_boundary_and_the_resumed_fit_ends_as_the_fit_left_alone(
    tmp_path, point, stopped
):
    """Ctrl-C (SIGINT to the fit's processes, as a terminal sends it) at the start of the first training step, or
    at the second of the first epoch's four validation batches, stops the fit as SIGTERM does: at the step's end
    with last.ckpt of that step, or with last.ckpt of the validation's start, and the exit status 130. The resumed
    fit (``--ckpt_path last``) ends with the metrics.csv rows and the weights of the fit left alone. Before, Ctrl-C
    saved the state where it landed: inside a step, the resumed fit logged its rows one step late and ended with
    other weights; inside a validation, it logged no validation row for that epoch."""
    weights, rows = {}, {}
    # The fit takes SIGINT, as a terminal's foreground command does. Where this suite runs as a background job of
    # a shell, SIGINT is ignored here, and the commands started from here would inherit that (a handler of this
    # process's is not inherited: the command starts with SIGINT's default, and Python raises KeyboardInterrupt).
    taken = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for name in ("alone", "stopped"):
            marks = {"marks": str(tmp_path / name / "marks")} if name == "stopped" else {}
            callback = {
                "class_path": "stop_points.StopAt",
                "init_args": {"points": [point], "signal_name": "SIGINT", **marks},
            }
            check = stopped if name == "stopped" else None
            run = two_epoch_fit(tmp_path / name, callback, check, stop_status=130, **{"data.eval_batch_size": 4})
            weights[name] = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
            logged = sorted(run.glob("metrics*.csv"))  # the stopped run's first attempt is metrics.part1.csv
            rows[name] = sorted({line for path in logged for line in path.read_text().splitlines()[1:]})
    finally:
        signal.signal(signal.SIGINT, taken)
    assert all(torch.equal(weights["stopped"][k], weights["alone"][k]) for k in weights["alone"])
    assert rows["stopped"] == rows["alone"] and len(rows["alone"]) == 4, rows


def test_a_second_ctrl_c_stops_the_fit_at_once_without_a_checkpoint_of_where_it_landed(tmp_path):
    """A second Ctrl-C, at the end of the step the first stopped at, stops the fit at once, as Lightning stops it
    (status 1). It writes no checkpoint of that point (the fit has none before its first epoch's end), and says so."""
    taken = signal.signal(signal.SIGINT, signal.default_int_handler)  # as above
    try:
        marks = {"marks": str(tmp_path / "marks"), "signal_name": "SIGINT"}
        callback = {"class_path": "stop_points.StopAt", "init_args": {"points": ["step:0", "step_end:1"], **marks}}
        options = {"trainer.max_epochs": 2, "trainer.limit_train_batches": 2, "model.arch": "test_resnet"}
        # a user's progress bar and a loader worker, which tiny_config turns off (W&B: tests/test_stop_anywhere.py)
        user = {"trainer.enable_progress_bar": True, "data.num_workers": 1}
        config = tiny_config(tmp_path, **options, **{"trainer.callbacks": [callback], **user})
        done = run_command(["fit", "--config", str(config)], cwd=tmp_path, timeout=240)
    finally:
        signal.signal(signal.SIGINT, taken)
    assert done.returncode == 1, done.stderr[-3000:]
    assert "fit interrupted by SIGINT (Ctrl-C) at epoch 0, step 1; no checkpoint of this step" in done.stderr
    assert not (tmp_path / "runs" / "tiny" / "version_0" / "checkpoints" / "last.ckpt").exists()
