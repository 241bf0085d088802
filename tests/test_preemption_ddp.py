"""Pre-emption loses no trained step (issue 37): SIGTERM under DDP saves the step the ranks stop at (a collective
at the step boundary) and exits 143, and the message says what happens next: the command that continues the fit,
or, after a SLURM requeue, that SLURM resumes the job from the requeue's checkpoint. Every fit is killed with all its
processes after a hard time limit: a hang fails the test instead of stalling the suite."""

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning import Callback

from helpers import REPO, WNIDS, fake_slurm_job, make_image_tree, run_command, tiny_config

STEPS_PER_EPOCH = 6
EPOCHS = 2
RANK_BATCH = 2  # images per rank and step


def digest(state_dict: dict[str, torch.Tensor]) -> str:
    """One hash of a module's state: names and values, bit for bit."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        h.update(name.encode())
        h.update(state_dict[name].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class StepRecord(Callback):
    """On rank zero, appends each trained step (global step, hash of the module's state after it) to ``record``;
    every rank then sleeps ``seconds``, so that a test can signal the fit mid-epoch. It runs before the stop at the
    step boundary (the config's callbacks come before robust-lightning's), so the stop step is recorded too."""

    def __init__(self, record: str, seconds: float = 0.0):
        self.record, self.seconds = record, seconds

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero:
            with open(self.record, "a") as f:
                f.write(json.dumps({"step": trainer.global_step, "digest": digest(pl_module.state_dict())}) + "\n")
        time.sleep(self.seconds)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _config(tmp_path: Path, data_root: Path, record: Path, seconds: float) -> Path:
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 2,
            "strategy": "ddp",
            "max_epochs": EPOCHS,
            "num_sanity_val_steps": 0,
            "limit_val_batches": 1,
            # a user's defaults: the progress display (printed lines: no terminal) and a loader worker per rank,
            # whose processes get the signal too
            "enable_progress_bar": True,
            "default_root_dir": str(tmp_path / "runs"),
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(tmp_path / "runs"), "name": "ddp"},
            },
            "callbacks": [
                {
                    "class_path": "test_preemption_ddp.StepRecord",
                    "init_args": {"record": str(record), "seconds": seconds},
                }
            ],
        },
        "model": {"arch": "test_resnet", "warmup_epochs": 0.5, "lr": 1e-3, "ema_decay": 0.9},
        "data": {
            "source": {"class_path": "FolderSource", "init_args": {"root": str(data_root)}},
            "num_classes": 1000,
            "image_size": 32,
            "batch_size": RANK_BATCH,
            "eval_batch_size": RANK_BATCH,
            "num_workers": 1,
        },
    }
    path = tmp_path / "fit.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class _InBackground(threading.Thread):
    """Runs ``run`` in a thread of its own; :meth:`result` waits for it and returns its result, or raises its error
    (a test failure included)."""

    def __init__(self, run: Callable[[], Any]):
        super().__init__(daemon=True)
        self.run_it, self.outcome = run, {}
        self.start()

    def run(self) -> None:
        try:
            self.outcome["value"] = self.run_it()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            self.outcome["error"] = e

    def result(self) -> Any:
        self.join()
        if "error" in self.outcome:
            raise self.outcome["error"]
        return self.outcome["value"]


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]


def _signal_mid_epoch(config: Path, cwd: Path, record: Path, signum: int = signal.SIGTERM) -> str:
    """Runs the fit in a session of its own, sends ``signum`` to every process of it (as SLURM and schedulers send
    SIGTERM, and a terminal Ctrl-C) once it trained 2 steps, and returns its output. A hang is killed, every rank
    with it, and fails the test."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    process = subprocess.Popen(
        [sys.executable, "-m", "robust_lightning", "fit", "--config", str(config)],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )
    try:
        deadline = time.time() + 240
        while len(_records(record)) < 2:
            assert process.poll() is None, process.communicate()[0][-3000:]
            assert time.time() < deadline, "the fit trained no 2 steps within 240 s"
            time.sleep(0.05)
        os.killpg(process.pid, signum)
        output = process.communicate(timeout=120)[0]  # a hang: TimeoutExpired, and every rank killed below
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == (130 if signum == signal.SIGINT else 143), output[-3000:]
    return output


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_sigterm_or_ctrl_c_under_ddp_saves_the_stop_step_and_the_resumed_fit_ends_as_the_whole_one(
    tmp_path, signal_name
):
    """SIGTERM, or Ctrl-C (SIGINT, as a terminal sends it), to every process of a 2-rank fit (gloo, CPU, a loader
    worker per rank) mid-epoch. The ranks stop at the step they agree on, save a checkpoint of that step together
    and exit 143 (130 for Ctrl-C); ``--ckpt_path last`` continues from that step, and the fit ends with the weights
    of the fit left alone, bit for bit.

    The comparison is as strict as the resume now guarantees: a fit resumed mid-epoch trains exactly the batches
    its interrupted attempt had not, with the same draws (tests/test_resume_mid_epoch.py, for step checkpoints).
    Here the checkpoint is the one the stop writes: it holds the stop step (its weights are the whole fit's after
    that step), each later step is trained exactly once (the state after each equals the whole fit's), and the
    data, the random draws, the optimiser, the schedule and the EMA continue as if the fit had never stopped."""
    data_root = tmp_path / "data"
    make_image_tree(data_root / "train", {w: 2 * RANK_BATCH * STEPS_PER_EPOCH // len(WNIDS) for w in WNIDS})
    make_image_tree(data_root / "val", {w: 1 for w in WNIDS})
    whole_dir, stopped_dir = tmp_path / "whole", tmp_path / "stopped"
    whole_dir.mkdir()
    stopped_dir.mkdir()
    whole_record, record = whole_dir / "steps.jsonl", stopped_dir / "steps.jsonl"

    # the fit left alone, beside the interrupted one (most of a fit's time is the start of its processes)
    whole_config = _config(whole_dir, data_root, whole_record, 0)
    whole = _InBackground(lambda: run_command(["fit", "--config", str(whole_config)], cwd=whole_dir, timeout=300))
    try:
        config = _config(stopped_dir, data_root, record, 0.4)
        # The fit takes SIGINT, as a terminal's foreground command does, even where this suite runs as a background
        # job of a shell, which ignores it (an ignored signal stays ignored in the processes started from here).
        taken = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            output = _signal_mid_epoch(config, stopped_dir, record, signal.Signals[signal_name])
        finally:
            signal.signal(signal.SIGINT, taken)
    finally:  # the fit left alone ends, or is killed at its time limit, within the test
        whole.join()
    finished = whole.result()
    assert finished.returncode == 0, finished.stderr[-3000:]
    reference = {r["step"]: r["digest"] for r in _records(whole_record)}
    assert sorted(reference) == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))

    trained = _records(record)
    stop = trained[-1]["step"]
    assert [r["step"] for r in trained] == list(range(1, stop + 1))
    assert 2 <= stop < STEPS_PER_EPOCH, output[-3000:]  # mid-epoch: no epoch checkpoint holds these steps
    run = stopped_dir / "runs" / "ddp" / "version_0"
    last = run / "checkpoints" / "last.ckpt"
    said = "SIGINT (Ctrl-C)" if signal_name == "SIGINT" else "SIGTERM"
    assert f"fit interrupted by {said} at epoch 0, step {stop}; checkpoint of this step: {last}" in output
    # the command as it runs in this shell (robust-lightning where that is on PATH, else the interpreter's -m form)
    assert re.search(r"^resume with: .*\bfit --config .* --ckpt_path last$", output, re.M), output[-3000:]
    status = "Ctrl-C (exit status 130)" if signal_name == "SIGINT" else "SIGTERM (exit status 143)"
    assert f"interrupted by {status}; the same command resumes it" in output
    saved = torch.load(last, map_location="cpu", weights_only=True)
    assert saved["global_step"] == stop and saved["epoch"] == 0
    assert digest(saved["state_dict"]) == trained[-1]["digest"] == reference[stop]  # the stop step's weights
    fit = json.loads((run / "results.json").read_text())["fit"]
    assert fit["interrupted"] == signal_name and fit["steps"] == stop

    # the command it printed, without the pace: each later step trained once, the fit ends as the whole one
    resumed = run_command(
        [
            "fit",
            "--config",
            str(config),
            "--ckpt_path",
            "last",
            "--trainer.callbacks",
            json.dumps([{"class_path": "test_preemption_ddp.StepRecord", "init_args": {"record": str(record)}}]),
        ],
        cwd=stopped_dir,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    later = _records(record)[len(trained) :]
    assert [r["step"] for r in later] == list(range(stop + 1, EPOCHS * STEPS_PER_EPOCH + 1))
    assert all(r["digest"] == reference[r["step"]] for r in later)
    expected, got = (
        _weights(d / "runs" / "ddp" / "version_0" / "checkpoints" / "last.ckpt") for d in (whole_dir, stopped_dir)
    )
    assert expected.keys() == got.keys() and any(k.startswith("ema.") for k in got)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


def _restart_job(
    config: Path, callbacks: list[dict], cwd: Path, slurm: dict[str, str], record: Path
) -> subprocess.CompletedProcess[str]:
    """The requeued job's restart: the same command (with ``callbacks``, the signalling one left out), which must
    finish; ``record`` is emptied first, so that it then lists the steps the restart trained."""
    record.unlink()
    command = ["fit", "--config", str(config), "--trainer.callbacks", json.dumps(callbacks)]
    restart = run_command(command, cwd=cwd, timeout=300, env=slurm)
    assert restart.returncode == 0, restart.stderr[-3000:]
    return restart


def test_a_slurm_requeue_stops_the_fit_at_its_step_and_says_slurm_resumes(tmp_path):
    """SLURM's requeue signal in step 3: the fit writes hpc_ckpt_1.ckpt of step 3 (the checkpoint SLURM's restart
    resumes from), asks scontrol to requeue the job and stops there, with exit status 143 (SLURM ends a requeued job
    at once; this test's scontrol does not). The message says that SLURM
    resumes the job from it, not to run a resume of one's own (that would be a second copy of the run). The job's
    restart (the same command in the same environment) resumes from it and trains each later step once. One
    process: the message and the checkpoint are the same under DDP, where the save is the collective of the test
    above. tiny_config's bar off and no loader workers: the message and the stop step do not depend on them; the
    weights after such a requeue are compared with the fit left alone, with the bar and loader workers on, in
    tests/test_slurm_restart.py (one process) and tests/test_slurm_requeue_ddp.py (2 tasks on real SLURM)."""
    record = tmp_path / "batches.jsonl"
    callbacks = [
        {"class_path": "slurm_cluster.Pace", "init_args": {"record": str(record), "seconds": 0}},
        {"class_path": "slurm_cluster.SignalMidStep", "init_args": {"step": 3}},
    ]
    config = tiny_config(
        tmp_path,
        **{
            "trainer.max_epochs": 1,
            "trainer.limit_train_batches": 7,
            "trainer.callbacks": callbacks,
            "data.batch_size": 2,
            "data.source.init_args.train_per_class": 4,
            "model.arch": "test_resnet",
        },
    )
    slurm = fake_slurm_job(tmp_path)
    first = run_command(["fit", "--config", str(config)], cwd=tmp_path, timeout=300, env=slurm)
    output = first.stdout + first.stderr
    assert first.returncode == 143, output[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    hpc = tmp_path / "runs" / "hpc_ckpt_1.ckpt"
    assert sorted(p.name for p in hpc.parent.glob("hpc_ckpt_*")) == [hpc.name]
    assert torch.load(hpc, map_location="cpu", weights_only=True)["global_step"] == 3
    assert [json.loads(line)["step"] for line in record.read_text().splitlines()] == [1, 2, 3]
    assert "fit stopped at epoch 0, step 3 for SLURM's requeue of the job" in output
    assert f"SLURM restarts the job, which resumes from {hpc}: nothing to run" in output
    assert f"stopped for SLURM's requeue (exit status 143); SLURM resumes the requeued job from {hpc}" in output
    assert "--ckpt_path" not in output

    restart = _restart_job(config, callbacks[:1], tmp_path, slurm, record)
    assert f"Restored all states from the checkpoint at {hpc}" in restart.stdout + restart.stderr
    assert [json.loads(line)["step"] for line in record.read_text().splitlines()] == [4, 5, 6, 7]


def test_a_slurm_requeue_signal_in_the_set_up_is_acted_on_at_the_first_step(tmp_path):
    """SLURM's requeue signal before the fit's own handlers are in place (in a callback's set-up, as it could land
    while the data is listed): its default action would end the process with status 138 and no requeue. The
    command line notes it from the start, so the fit stops after its first step, writes hpc_ckpt_1.ckpt and asks
    scontrol to requeue the job; the job's restart trains the other steps once each. After each step the weights
    are those of the same fit left alone, bit for bit. tiny_config's bar off and no loader workers: as in the
    requeue test above, the stop's path does not depend on them (tests/test_slurm_restart.py compares a requeued
    fit's weights with them on)."""
    whole_dir, requeued_dir = tmp_path / "whole", tmp_path / "requeued"
    overrides = {"trainer.max_epochs": 1, "trainer.limit_train_batches": 4, "model.arch": "test_resnet"}
    configs, records = {}, {}
    for directory in (whole_dir, requeued_dir):
        directory.mkdir()
        records[directory] = directory / "steps.jsonl"
        step_record = {"class_path": "test_preemption_ddp.StepRecord", "init_args": {"record": str(records[directory])}}
        signal_in_setup = [{"class_path": "slurm_cluster.SignalInSetup"}] if directory == requeued_dir else []
        callbacks = [step_record, *signal_in_setup]
        configs[directory] = tiny_config(directory, **overrides, **{"trainer.callbacks": callbacks})

    # the fit left alone, in the same SLURM job's environment, beside the requeued one
    whole_env = fake_slurm_job(whole_dir)
    whole = _InBackground(
        lambda: run_command(["fit", "--config", str(configs[whole_dir])], cwd=whole_dir, timeout=300, env=whole_env)
    )
    try:
        slurm = fake_slurm_job(requeued_dir)
        first = run_command(["fit", "--config", str(configs[requeued_dir])], cwd=requeued_dir, timeout=300, env=slurm)
    finally:  # the fit left alone ends, or is killed at its time limit, within the test
        whole.join()
    finished = whole.result()
    assert finished.returncode == 0, finished.stderr[-3000:]
    reference = {r["step"]: r["digest"] for r in _records(records[whole_dir])}
    assert sorted(reference) == [1, 2, 3, 4]

    output = first.stdout + first.stderr
    assert first.returncode == 143, output[-3000:]
    assert (requeued_dir / "scontrol.log").read_text() == "requeue 4242\n"
    hpc = requeued_dir / "runs" / "hpc_ckpt_1.ckpt"
    saved = torch.load(hpc, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 1 and digest(saved["state_dict"]) == reference[1]
    assert [(r["step"], r["digest"]) for r in _records(records[requeued_dir])] == [(1, reference[1])]
    assert "stopped for SLURM's requeue (exit status 143)" in output and "Traceback" not in output

    step_record = yaml.safe_load(configs[requeued_dir].read_text())["trainer"]["callbacks"][:1]
    _restart_job(configs[requeued_dir], step_record, requeued_dir, slurm, records[requeued_dir])
    later = _records(records[requeued_dir])
    assert [(r["step"], r["digest"]) for r in later] == [(step, reference[step]) for step in (2, 3, 4)]


def test_a_refused_slurm_requeue_stops_the_fit_with_last_ckpt_and_the_command_that_resumes_it(tmp_path):
    """SLURM's requeue signal in step 3, and ``scontrol requeue`` fails. The fit stops there all the same (its time
    limit is near, and its W&B run is finished), warns that the requeue failed, writes last.ckpt of step 3 beside
    hpc_ckpt_1.ckpt and prints the command that continues it, which trains each later step once. tiny_config's
    bar off and no loader workers: the refusal's path does not depend on them (last.ckpt's resume with them on is
    compared with the fit left alone in tests/test_preemption_ddp.py's SIGTERM test above)."""
    record = tmp_path / "batches.jsonl"
    callbacks = [
        {"class_path": "slurm_cluster.Pace", "init_args": {"record": str(record), "seconds": 0}},
        {"class_path": "slurm_cluster.SignalMidStep", "init_args": {"step": 3}},
    ]
    overrides = {
        "trainer.max_epochs": 1,
        "trainer.limit_train_batches": 7,
        "data.batch_size": 2,
        "data.source.init_args.train_per_class": 4,
        "model.arch": "test_resnet",
    }
    config = tiny_config(tmp_path, **overrides, **{"trainer.callbacks": callbacks})
    slurm = fake_slurm_job(tmp_path)
    scontrol = tmp_path / "bin" / "scontrol"
    scontrol.write_text(scontrol.read_text() + "exit 1\n")
    first = run_command(["fit", "--config", str(config)], cwd=tmp_path, timeout=300, env=slurm)
    output = first.stdout + first.stderr
    assert first.returncode == 143, output[-3000:]
    assert "Requeuing SLURM job 4242 failed: 1" in output
    assert torch.load(tmp_path / "runs" / "hpc_ckpt_1.ckpt", map_location="cpu", weights_only=True)["global_step"] == 3
    saved = re.search(r"checkpoint of this step: (\S+)", output)
    assert saved and torch.load(saved[1], map_location="cpu", weights_only=True)["global_step"] == 3, output[-3000:]
    assert "SLURM resumes" not in output and "--ckpt_path last" in output

    record.unlink()
    del slurm["SLURM_JOB_ID"]  # the resume the message advises, outside the job
    resumed = run_command(
        ["fit", "--config", str(config), "--trainer.callbacks", json.dumps(callbacks[:1]), "--ckpt_path", "last"],
        cwd=tmp_path,
        timeout=300,
        env=slurm,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [json.loads(line)["step"] for line in record.read_text().splitlines()] == [4, 5, 6, 7]
