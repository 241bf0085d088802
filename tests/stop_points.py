"""Stops of a running command at chosen points, as a scheduler stops a job: SIGTERM (or another signal) to every
process of it, the ranks, their loader workers and W&B's service process (wandb-core, which runs in a session of
its own) alike, as SLURM's process tracking reaches every process a job step started.

A config names the callback (tests/ is on the command's PYTHONPATH in tests/helpers.py's run_command). Each stop
point fires once across a run's attempts: a file in ``marks`` records that it fired, so the resumed attempt runs
past it."""

import ctypes
import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path

from lightning import Callback
from lightning.pytorch.utilities.exceptions import SIGTERMException

from robust_lightning import cli
from robust_lightning.analysis.hessian import HessianSpectrum
from robust_lightning.evaluation.autoattack import AutoAttackEvaluation
from robust_lightning.evaluation.imagenet_p import ImageNetP
from robust_lightning.job_signals import JobSignals


def parent_of(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    """Every process started by ``pid``, its children's children included (read from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (parent := parent_of(int(entry))) is not None:
            children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def signal_job(signum: int) -> None:
    """``signum`` to this job: the process at the top of this one's tree of robust-lightning processes (rank zero
    under Lightning's launcher) and everything it started. Sent by a process of its own, as a scheduler's comes
    from outside: a loader worker ends on its parent's SIGTERM, and drops any other
    (robust_lightning.job_signals)."""
    top, parent = os.getpid(), parent_of(os.getpid())
    while parent is not None and " -m robust_lightning" in _command_line(parent):  # rank zero started this rank
        top, parent = parent, parent_of(parent)
    pids = [str(pid) for pid in [top, *descendants(top)]]
    subprocess.run(["kill", f"-{signal.Signals(signum).name.removeprefix('SIG')}", *pids], check=False)


def _command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class _Once:
    def __init__(self, marks: str | None, signal_name: str) -> None:
        self.marks = Path(marks) if marks else None
        self.signum = signal.Signals[signal_name]

    def fire(self, trainer, point: str) -> None:
        """Signal the job at ``point``, once across the run's attempts (from rank zero)."""
        if self.marks is None or not trainer.is_global_zero:
            return
        mark = self.marks / point
        if mark.exists():
            return
        self.marks.mkdir(parents=True, exist_ok=True)
        mark.write_text(str(trainer.global_step))
        signal_job(self.signum)


class StopAt(Callback):
    """Signals the job once at each of ``points``: "step:<global step>" (the start of that training step),
    "validation:<epoch>:<batch>" (the start of that validation batch), "save:<epoch>" (in the first checkpoint's
    save of that epoch: the epoch-end one after its validation). ``marks``: the folder recording the points that
    fired (None: none fire, the run left alone)."""

    def __init__(self, points: list[str], marks: str | None = None, signal_name: str = "SIGTERM") -> None:
        self.points, self.once = set(points), _Once(marks, signal_name)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        point = f"step:{trainer.global_step}"
        if point in self.points:
            self.once.fire(trainer, point)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        point = f"step_end:{trainer.global_step}"
        if point in self.points:
            self.once.fire(trainer, point)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        point = f"validation:{trainer.current_epoch}:{batch_idx}"
        if not trainer.sanity_checking and point in self.points:
            self.once.fire(trainer, point)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        point = f"save:{trainer.current_epoch}"
        if point in self.points:
            self.once.fire(trainer, point)


class SaveFailsAfterASignal(Callback):
    """Every checkpoint save after a job's signal was noted fails as on a full disk: an error while the stop is
    under way."""

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        if JobSignals.noted():
            raise OSError(errno.ENOSPC, "No space left on device", trainer.default_root_dir)


class _SigAction(ctypes.Structure):
    """Linux's struct sigaction as glibc lays it out (x86-64 and arm64)."""

    _fields_ = [
        ("handler", ctypes.c_void_p),
        ("mask", ctypes.c_ulong * (1024 // (8 * ctypes.sizeof(ctypes.c_ulong)))),
        ("flags", ctypes.c_int),
        ("restorer", ctypes.c_void_p),
    ]


SA_RESTART = 0x10000000


def restarts_interrupted_calls(signum: int) -> bool:
    """Whether ``signum``'s handler has SA_RESTART: a system call it interrupts (a collective's socket read)
    restarts instead of failing with EINTR."""
    action = _SigAction()
    if ctypes.CDLL(None, use_errno=True).sigaction(signum, None, ctypes.byref(action)) != 0:
        raise OSError(ctypes.get_errno(), "sigaction")
    return bool(action.flags & SA_RESTART)


class RecordRestartFlags(Callback):
    """Records in the JSON file ``out`` whether SIGTERM's handler restarts interrupted system calls in training
    and in the end-of-fit evaluations' hook (on_fit_end)."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)

    def _record(self, where: str) -> None:
        seen = json.loads(self.out.read_text()) if self.out.exists() else {}
        self.out.write_text(json.dumps({**seen, where: restarts_interrupted_calls(signal.SIGTERM)}))

    def on_train_start(self, trainer, pl_module) -> None:
        self._record("training")

    def on_fit_end(self, trainer, pl_module) -> None:
        self._record("fit end")


class SignalAgainAtTheEnd(Callback):
    """After the first stop of the run's attempts (``marks``), signals the job once more while rank zero ends its
    W&B run, after the command has returned, as SLURM signals a job it requeues and srun the tasks left once one
    has exited. The hook into the command line is a stand-in for that moment: the callback wraps
    ``robust_lightning.cli.finish_wandb_run`` in rank zero's process."""

    def __init__(self, marks: str | None = None, signal_name: str = "SIGTERM") -> None:
        self.once = _Once(marks, signal_name)

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or not trainer.is_global_zero:
            return
        finish = cli.finish_wandb_run

        def signalled_first(*args, **kwargs):
            self.once.fire(trainer, "again")
            return finish(*args, **kwargs)

        cli.finish_wandb_run = signalled_first


class AutoAttackStoppedAt(AutoAttackEvaluation):
    """The AutoAttack evaluation, signalling the job once after its ``after``-th batch (on rank zero) when ``marks``
    is given."""

    def __init__(self, after: int = 1, marks: str | None = None, signal_name: str = "SIGTERM", **options) -> None:
        super().__init__(**options)
        self.after, self.batches, self.once = after, 0, _Once(marks, signal_name)

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        super().on_test_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
        self.batches += 1
        if self.batches == self.after:
            self.once.fire(trainer, f"autoattack:{self.after}")


class ImageNetPStoppedAt(ImageNetP):
    """The ImageNet-P evaluation, signalling the job once in its first forward pass (on rank zero) when ``marks`` is
    given: while its loader workers are decoding the next sequences."""

    def __init__(self, marks: str | None = None, signal_name: str = "SIGTERM", **options) -> None:
        super().__init__(**options)
        self.once = _Once(marks, signal_name)

    def on_test_end(self, trainer, pl_module) -> None:
        hook = pl_module.register_forward_pre_hook(lambda module, inputs: self.once.fire(trainer, "imagenet_p"))
        try:
            super().on_test_end(trainer, pl_module)
        finally:
            hook.remove()


class HessianSpectrumStoppedAt(HessianSpectrum):
    """HessianSpectrum during a fit, signalling the job once (``marks``) when the spectrum of the first analysed
    epoch takes its second minibatch: after one minibatch's eigenvalues, before the next one's."""

    def __init__(self, marks: str | None = None, signal_name: str = "SIGTERM", **options) -> None:
        super().__init__(**options)
        self.once = _Once(marks, signal_name)

    def setup(self, trainer, pl_module, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self.trainer = trainer

    def spectrum(self, model, minibatches, weight_decay, records=None):
        def signalled():
            for i, minibatch in enumerate(minibatches):
                if i == 1:
                    self.once.fire(self.trainer, "hessian")
                yield minibatch

        return super().spectrum(model, signalled(), weight_decay, records)


class StopLocalSweepAt(Callback):
    """Stops the local sweep that runs this cell once (``marks``), at the start of validation batch ``batch``, as
    a user does: SIGTERM to the sweep's process (``kill``), or SIGINT to the process group (Ctrl-C in the
    terminal, which reaches the cell too). Then it waits for the signal to reach this process (SIGTERM passed on
    by the sweep); SIGINT raises KeyboardInterrupt here."""

    def __init__(self, marks: str, signal_name: str, batch: int = 1) -> None:
        self.marks, self.signum, self.batch = Path(marks), signal.Signals[signal_name], batch

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        mark = self.marks / "stopped"
        if batch_idx != self.batch or mark.exists():
            return
        self.marks.mkdir(parents=True, exist_ok=True)
        mark.write_text(self.signum.name)
        if self.signum == signal.SIGTERM:
            os.kill(os.getppid(), signal.SIGTERM)
        else:
            os.killpg(0, self.signum)
        deadline = time.monotonic() + 60
        while not JobSignals.noted() and time.monotonic() < deadline:
            time.sleep(0.05)
