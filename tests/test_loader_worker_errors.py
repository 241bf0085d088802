"""An error in a DataLoader worker ends the command: its one message, exit status 2, and no worker left behind.

The loader workers ignore a scheduler's SIGTERM and SIGUSR1 (robust_lightning/job_signals.py). A worker that also
ignored its own parent's SIGTERM kept a command that failed mid-epoch from ever exiting: the exiting process
terminates its daemonic children with SIGTERM and then waits for them. Each command here runs in a session of its
own under a kill timer, so a hang fails the test instead of stalling the suite.
"""

import contextlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from lightning import Callback

from helpers import REPO, WNIDS, make_image_tree
from robust_lightning.data.shards import convert_image_folder
from robust_lightning.job_signals import ignore_job_signals

KILL_AFTER = 120  # seconds; each command takes a few seconds here, a hang never ends


class RecordForkedChildren(Callback):
    """Appends the pid of every process forked from now on (the loader workers) to a file."""

    def __init__(self, path: str):
        def record() -> None:
            with open(path, "a") as f:
                f.write(f"{os.getpid()}\n")

        os.register_at_fork(after_in_child=record)


@pytest.fixture(scope="module")
def truncated_shards(tmp_path_factory):
    """Training and validation shards written by the shard converter, named by brace patterns; the second of
    the three validation shards is cut in the middle of the file."""
    root = tmp_path_factory.mktemp("worker-errors")
    make_image_tree(root / "images" / "train", {w: 8 for w in WNIDS})
    make_image_tree(root / "images" / "val", {w: 4 for w in WNIDS})
    for split in ("train", "val"):
        convert_image_folder(
            root / "images" / split, root / split, samples_per_shard=4, verify=False, workers=1, progress=False
        )
    val = sorted((root / "val").glob("val-*.tar"))
    assert len(val) == 3 and len(list((root / "train").glob("train-*.tar"))) == 6
    data = val[1].read_bytes()
    val[1].write_bytes(data[: len(data) // 2])
    return root, val[1]


def _config(tmp_path: Path, shards: Path, pids: Path) -> Path:
    runs = str(tmp_path / "runs")
    config = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": 1,
            "num_sanity_val_steps": 0,
            "enable_progress_bar": False,
            "default_root_dir": runs,
            "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": runs}},
            "callbacks": [
                {"class_path": "test_loader_worker_errors.RecordForkedChildren", "init_args": {"path": str(pids)}}
            ],
        },
        "model": {"arch": "test_resnet", "warmup_epochs": 0, "lr": 1e-3},
        "data": {
            "source": {
                "class_path": "ShardSource",
                "init_args": {
                    "train_shards": str(shards / "train" / "train-{000000..000005}.tar"),
                    "val_shards": str(shards / "val" / "val-{000000..000002}.tar"),
                    "train_size": 24,
                },
            },
            "image_size": 32,
            "batch_size": 8,
            "num_workers": 2,
        },
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _alive(pid: int, session: int) -> bool:
    """Whether ``pid`` is a process of ``session`` that has not exited (a zombie has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    state, _parent, group = stat.rpartition(")")[2].split()[:3]
    return state != "Z" and int(group) == session


def _session_processes(session: int) -> list[str]:
    """The command lines of the live processes of a session (its process group, as started here)."""
    lines = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and _alive(int(proc.name), session):
            with contextlib.suppress(OSError):
                words = (proc / "cmdline").read_bytes().split(b"\0")
                lines.append(f"{proc.name}: {b' '.join(words).decode(errors='replace')}")
    return lines


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("command", ["validate", "fit", "test"])
def test_a_worker_error_ends_the_command_with_its_message_and_no_worker_left(truncated_shards, tmp_path, command):
    shards, truncated = truncated_shards
    pids = tmp_path / "worker-pids.txt"
    config = _config(tmp_path, shards, pids)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")]),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "robust_lightning", command, "--config", str(config)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    left: list[str] = []
    try:
        # the workers hold the output pipes too: this returns once every process of the command has ended
        _, err = process.communicate(timeout=KILL_AFTER)
    except subprocess.TimeoutExpired:
        left = _session_processes(process.pid)
        err = None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    if err is None:
        err = process.communicate()[1]
        pytest.fail(
            f"{command} did not end within {KILL_AFTER} s; processes left:\n" + "\n".join(left) + f"\n{err[-3000:]}"
        )

    assert process.returncode == 2, err[-3000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("robust-lightning: error:")]
    assert len(errors) == 1 and truncated.name in errors[0], err[-3000:]
    workers = [int(line) for line in pids.read_text().split()]
    assert len(workers) >= 2  # the loader's workers were on
    deadline = time.monotonic() + 5
    while any(_alive(pid, process.pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if _alive(pid, process.pid)]


def _shielded_worker(ready) -> None:
    ignore_job_signals(0)  # as the data module's worker_init_fn does
    ready.send(True)
    while True:
        time.sleep(60)


def sigterm_pending(pid: int) -> bool:
    """Whether a SIGTERM waits to be taken by the process ``pid`` (its shared pending set, /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    pending = int(next(line.split()[1] for line in status.splitlines() if line.startswith("ShdPnd:")), 16)
    return bool(pending & (1 << (signal.SIGTERM - 1)))


def _process_state(pid: int) -> str:
    """What /proc says of ``pid`` (its state and pending and blocked signals), for a failure's message."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except FileNotFoundError:
        return f"pid {pid} is gone: reaped by another wait than the test's"
    return "; ".join(line for line in lines if line.startswith(("State", "ShdPnd", "SigPnd", "SigBlk", "SigIgn")))


def _signal_from_another_process(pid: int, signum: int) -> None:
    code = f"import os; os.kill({pid}, {int(signum)})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def parent_sigterm_scenario() -> None:
    """The test below, in the process that is the worker's parent: SIGTERM and SIGUSR1 from another process (a
    scheduler) leave a worker running; SIGTERM from its parent ends it at once with status 0."""
    context = multiprocessing.get_context("fork")
    receiver, sender = context.Pipe(duplex=False)
    worker = context.Process(target=_shielded_worker, args=(sender,), daemon=True)
    worker.start()
    try:
        assert receiver.poll(60) and receiver.recv()
        _signal_from_another_process(worker.pid, signal.SIGTERM)
        _signal_from_another_process(worker.pid, signal.SIGUSR1)
        # a pending SIGTERM would absorb the parent's (two pending SIGTERMs are one): wait until it was taken
        deadline = time.monotonic() + 30
        while sigterm_pending(worker.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        worker.join(1)
        assert worker.is_alive()
        # SIGTERM from the parent; sent again should it merge with one still pending (the wait above is bounded)
        for _ in range(3):
            worker.terminate()
            worker.join(10)
            if not worker.is_alive():
                break
        assert worker.exitcode == 0, _process_state(worker.pid)
    finally:
        if worker.is_alive():
            worker.kill()
            worker.join()


@pytest.mark.skipif(not hasattr(signal, "sigwaitinfo"), reason="the sender of a signal cannot be read")
def test_a_loader_worker_ignores_a_schedulers_signals_but_ends_on_its_parents_sigterm():
    """SIGTERM and SIGUSR1 from another process (a scheduler) leave a worker running; SIGTERM from its parent, as
    the exiting training process sends it, ends the worker at once with status 0 (as torch's own handler does).

    The parent is a fresh process, as a training's is. Forked from the test process, in 2 of 5 full-suite runs the
    worker's exit status was never seen (exitcode None after its parent's third SIGTERM), which other tests' state
    in that process can cause: a thread of theirs that reaps any child takes the status from multiprocessing."""
    result = subprocess.run(
        [sys.executable, "-c", "import test_loader_worker_errors as t; t.parent_sigterm_scenario()"],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=KILL_AFTER,
    )
    assert result.returncode == 0, result.stderr
