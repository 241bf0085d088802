"""How the processes of a job take its signals: who ignores them, how a command stops at a batch boundary
(:class:`JobSignals`, :func:`stop_requested`, :func:`agree_to_stop`), and who requeues the job
(:func:`requeue_this_job`).

Every Trainer command notes SIGTERM (pre-emption, a time limit, ``scancel``) and SLURM's requeue signal and does
nothing else inside the handler: a handler runs wherever the process was, in the middle of a collective or of a
checkpoint's write. The command acts on a noted signal at its next batch boundary, in training, in validation, in
a test and in an evaluation's own loop alike. Under DDP the ranks must stop together, because whatever comes next
(a checkpoint's save, a metric's reduction) is a collective. So a rank that noted a signal tells the others
through the process group's key-value store, which every rank reads at each batch boundary without a collective,
and each loop ends with one small collective at which the ranks agree whether to stop (:func:`agree_to_stop`). A
rank that has its own share of batches left joins that agreement at its next batch boundary, or at its last
batch. Every rank then raises :class:`JobStopped`, whose exit status is 143, the shell's for SIGTERM.

The first Ctrl-C is noted in the same way, and stops the command with the status 130, the shell's for SIGINT; a
second one raises KeyboardInterrupt wherever it lands. Forked children ignore Ctrl-C: a terminal sends it to every
process of the command, and the training process decides when its workers end.

Processes started by srun: SLURM delivers the requeue signal (``--signal=SIGUSR1@90``,
``scancel --signal=USR1``) and the stop signal (SIGTERM: pre-emption, time limit, scancel) to every process of the
job step, forked DataLoader workers included. A forked worker inherits Lightning's handlers and runs them itself:
on SIGUSR1 it saves an hpc_ckpt_N.ckpt from its stale copy of the trainer (which can overwrite the real one, so the
requeued job resumes from an older step) and requeues the job once more; on SIGTERM it would signal and broadcast
to the ranks from its copy. Children forked by a process that called :func:`shield_forked_children` ignore both
instead; the training process handles them alone, and its workers end with it. DataLoader workers need it again
at their start (:func:`ignore_job_signals` as their ``worker_init_fn``): torch's worker loop installs a SIGTERM
handler of its own, which ends the worker unless its parent sent the signal, and the loader then fails the
training process with "DataLoader worker ... is killed by signal: Terminated". ``robust-lightning`` (also as
``python -m robust_lightning``, which needs no console script on the compute nodes) and a sweep's cells call it
first thing.

A loader worker must still end when its own parent sends SIGTERM: that is how a worker left running is ended when
the training process exits (multiprocessing's exit handler terminates every daemonic child, then waits for it). A
worker is left running when an error ends a command in the middle of an epoch: the loader's iterator, which would
tell its workers to stop, is then kept alive by the error's traceback until the process exits. A worker that
ignored every SIGTERM kept the exiting process waiting for ever. So a loader worker blocks SIGTERM and a thread of
its own takes each one: from its parent it ends the worker (status 0, as torch's own handler does); from anyone
else (the scheduler) it is dropped.

The command line notes SLURM's requeue signal from the start of a Trainer command, before its set-up
(:meth:`JobSignals.start_slurm_command`): its default action would end the process at once, without the requeue.

The other commands (``shards``, ``export``, ``report``, ...) have no batch boundary to stop at. Within
:func:`tool_stops_on_job_signals`, SIGTERM and SLURM's requeue signal raise :class:`ToolStopped` wherever the
process is, as Ctrl-C raises KeyboardInterrupt, so their clean-ups run; the command line then requeues the job on
the requeue signal. While a process pool works for them (:func:`pool_map`), these signals and Ctrl-C are noted
instead, and raised between two of its results. Their pools' workers are forked (:func:`process_pool`), so they
ignore both signals as the loader workers do, and end with the command.

Before Python 3.12, a process that called :func:`shield_forked_children` also makes each fork wait for a thread
that holds the interpreter's runtime lock: a child forked while another thread held that lock waits for it forever
(CPython gh-112275).
"""

import atexit
import ctypes
import logging
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from contextlib import contextmanager, suppress
from types import FrameType
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_info, rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

log = logging.getLogger(__name__)

Result = TypeVar("Result")


def ignore_job_signals(worker_id: int | None = None) -> None:
    """Ignore SLURM's requeue and stop signals, and Ctrl-C, in this process, a forked child: its parent stops at
    its next batch boundary, and a loader worker that ended on Ctrl-C would fail the batches fetched until then.
    Given a worker id (as a DataLoader's ``worker_init_fn``), the worker still ends on a SIGTERM that its parent
    sends."""
    try:
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # forked from a thread other than the main one: Python cannot set handlers there
        pass
    if worker_id is not None:
        end_on_parent_sigterm()


def end_on_parent_sigterm() -> None:
    """End this process (status 0) when its parent sends it SIGTERM, and drop a SIGTERM from anyone else.

    SIGTERM is blocked in this thread, and so in every thread it starts later; a daemon thread waits for it and
    reads who sent it. Call it before the process starts threads of its own (a forked worker, first thing). Where
    the sender cannot be read (no ``sigwaitinfo``), SIGTERM stays as it was."""
    if not hasattr(signal, "sigwaitinfo"):
        return
    parent = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait_for_sigterm() -> None:
        while True:
            if signal.sigwaitinfo({signal.SIGTERM}).si_pid == parent:
                os._exit(0)

    threading.Thread(target=wait_for_sigterm, name="end-on-parent-sigterm", daemon=True).start()


def shield_forked_children() -> None:
    hooks: dict[str, Callable[[], object]] = {"after_in_child": ignore_job_signals}
    if sys.version_info < (3, 12):
        # CPython gh-112275: before 3.12, a forked child takes the interpreter's runtime lock (HEAD_LOCK) before it
        # reinitialises it, so it hangs forever if another thread held that lock at the fork. Gloo's threads take
        # it without the GIL each time they release a tensor that Python created. sys._current_frames takes and
        # releases it, so the fork waits for a thread that holds it now. A thread can still take it between then
        # and the fork: this narrows the window without closing it (benchmarks/fork_race.py measures both).
        hooks["before"] = sys._current_frames
    os.register_at_fork(**hooks)
    atexit.register(_end_daemonic_children)


def end_with_parent(parent: int) -> None:
    """A process pool worker's initializer (``initargs=(os.getpid(),)``): the kernel kills the worker when its
    parent ends. A parent ended by a signal (``kill``) leaves its pool's workers behind otherwise, and they wait
    for work for ever, holding what they inherited: the synthetic dataset's lock, so that the next command that
    needs the dataset waits for ever too. Linux's prctl(PR_SET_PDEATHSIG); elsewhere it does nothing."""
    if not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # the parent ended before the call
        os._exit(1)


def _end_daemonic_children() -> None:
    """At exit, the loader workers still running (an error left them mid-epoch) are killed before multiprocessing's
    own exit handler sends them SIGTERM and waits for them: a scheduler's SIGTERM still pending in a worker absorbs
    its parent's (two pending SIGTERMs are one), and the exit would wait for the job's SIGKILL."""
    for child in multiprocessing.active_children():
        if child.daemon:
            child.kill()


def requeue_this_job(signum: int, then: str) -> bool:
    """``scontrol requeue`` of this SLURM job (an array job's own task), as Lightning's requeue handler runs it, on
    the requeue signal ``signum``; ``then`` says what the requeued job does. Called by rank zero alone. Returns
    whether SLURM took the requeue; a failure is logged as a warning."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ.get('SLURM_ARRAY_TASK_ID')}" if array_job else os.environ.get("SLURM_JOB_ID", "")
    if not re.fullmatch(r"[0-9_]+", job):
        log.warning(f"the requeue signal ({signum}) came, but this is no SLURM job to requeue (job id {job!r})")
        return False
    rank_zero_info(f"Handling auto-requeue signal: {signum}: requeueing SLURM job {job}; {then}")
    status: int | str  # the exit status, or why scontrol could not run
    try:
        status = _scontrol_ignoring_sigterm(["scontrol", "requeue", job])
    except OSError as e:
        status = f"{type(e).__name__}: {e}"
    if status != 0:
        log.warning(f"Requeuing SLURM job {job} failed: {status}")
        return False
    rank_zero_info(f"Requeued SLURM job: {job}")
    return True


def _scontrol_ignoring_sigterm(command: list[str]) -> int:
    """The exit status of ``command``, started with SIGTERM ignored. SLURM sends SIGTERM to every process of a job
    as soon as it takes the job's requeue, scontrol's own included: killed before it exited, scontrol reported the
    requeue it had done as failed (status -15). An ignored signal stays ignored across exec, so the child inherits
    it; this process ignores SIGTERM only while it starts the child, and notes nothing then that it would act on (it
    is stopping already)."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN) if in_main_thread else None
    try:
        process = subprocess.Popen(command)
    finally:
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    return process.wait()


# ------------------------------------------------------------------------------------- stopping at a batch boundary
EXIT_SIGTERM = 128 + 15  # the shell's status for a process ended by SIGTERM
EXIT_CTRL_C = 128 + 2  # the shell's status for a process ended by SIGINT


class JobStopped(SIGTERMException):
    """A command stopped at a batch boundary by SIGTERM, SLURM's requeue signal or Ctrl-C. It is Lightning's
    ``SIGTERMException``, a ``SystemExit``, with the status 143 (130 for Ctrl-C alone): a script that calls the
    Python API ends as a command stopped by the signal does. ``requeue`` says whether SLURM asked for a requeue,
    ``ctrl_c`` whether Ctrl-C was the only signal; ``where`` names the work it stopped (a training step, a
    validation, an evaluation), for the message and the checkpoint. What the stop did is added by whoever handles
    it: ``requeued`` (SLURM took the requeue) and ``checkpoint`` (the file the run resumes from)."""

    def __init__(self, requeue: bool, where: str, ctrl_c: bool = False) -> None:
        SystemExit.__init__(self, EXIT_CTRL_C if ctrl_c else EXIT_SIGTERM)
        self.requeue, self.where, self.ctrl_c = requeue, where, ctrl_c
        self.requeued = False
        self.checkpoint: str | None = None


class JobSignals:
    """The signals this process noted, and the handlers that note them. One per process: signals are a
    process's."""

    sigterm = False  # SIGTERM came
    requeue = False  # SLURM's requeue signal came
    ctrl_c = False  # SIGINT came (Ctrl-C)
    started = False  # a command is running: start_command was called, give_back not yet
    told_others = False  # the store holds this process's stop
    generation = 0  # which command of the process the store's key is for (every rank runs the same commands)
    _previous: dict[int, Any] = {}  # noqa: RUF012 (the process's one state)
    _unacted: list[int] = []  # noqa: RUF012 (the same) the signals noted that no stop has acted on yet

    @classmethod
    def take(
        cls, requeue_signal: int | None, on_sigterm: Callable[[int], None] | None = None, sigterm: bool = True
    ) -> None:
        """Note SIGTERM (unless ``sigterm`` is False) and the requeue signal (None: not on SLURM, or auto-requeue
        off) from now on, in the main thread. ``on_sigterm`` also runs in the handler (to pass the signal to the
        processes this one started). Taking them again keeps what was noted; :meth:`give_back` restores the
        handlers found first.

        With SIGTERM, the first Ctrl-C is noted too, unless the process ignores SIGINT. Raised where it lands, as
        Python does, it could cut a training step anywhere: between the optimizer's step and the loop's count of
        it, for one. A checkpoint saved there resumes another run than the one left alone. The first Ctrl-C gives
        SIGINT's earlier handler back, so a second one stops the command at once."""
        if threading.current_thread() is not threading.main_thread():
            return

        def note_sigterm(signum: int, frame: FrameType | None) -> None:
            if not cls.sigterm and on_sigterm is not None:
                on_sigterm(signum)
            cls.sigterm = True
            cls._note(signum)
            log.info("received SIGTERM: stopping at the next batch boundary")

        def note_requeue(signum: int, frame: FrameType | None) -> None:
            cls.requeue = True
            cls._note(signum)
            log.info("received SLURM's requeue signal: stopping at the next batch boundary")

        def note_ctrl_c(signum: int, frame: FrameType | None) -> None:
            cls.ctrl_c = True
            cls._note(signum)
            earlier = cls._previous.get(signal.SIGINT)
            signal.signal(signal.SIGINT, earlier if earlier is not None else signal.default_int_handler)
            if getattr(rank_zero_only, "rank", 0) == 0:  # written unbuffered: the handler may cut a write to stderr
                os.write(2, b"\nCtrl-C: stopping at the next batch boundary (Ctrl-C again stops at once)\n")

        takes_ctrl_c = sigterm and not cls.ctrl_c and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
        for signum, handler in (
            (signal.SIGTERM if sigterm else None, note_sigterm),
            (requeue_signal, note_requeue),
            (signal.SIGINT if takes_ctrl_c else None, note_ctrl_c),
        ):
            if signum is None:
                continue
            cls._previous.setdefault(signum, signal.getsignal(signum))
            signal.signal(signum, handler)
            # a system call the signal interrupts (a collective's socket read) is restarted instead of failing
            signal.siginterrupt(signum, False)

    @classmethod
    def give_back(cls, then_ignored: bool = False) -> None:
        """The handlers found before :meth:`take`; what was noted stays noted. With ``then_ignored``, SIGTERM and
        the signals taken are ignored instead (:func:`ignored_until_exit`), except Ctrl-C: a user can always end
        the process."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, handler in cls._previous.items():
            earlier = handler if handler is not None else signal.SIG_DFL
            signal.signal(signum, signal.SIG_IGN if then_ignored and signum != signal.SIGINT else earlier)
        if then_ignored:
            ignored_until_exit()  # SIGTERM too where the command had not taken it
        cls._previous = {}
        cls.started = False

    @classmethod
    def _note(cls, signum: int) -> None:
        if signum not in cls._unacted:
            cls._unacted.append(signum)

    @classmethod
    def pass_on_unacted(cls) -> None:
        """Raise again, after :meth:`give_back`, the signals the command noted but did not act on: they came after
        its last batch boundary. A caller of the Python API (``robust_lightning.cli.main(args)``,
        ``robust_lightning.evaluate``) then gets them from its own handlers, as if no command had been running.
        A command line's process, which exits, ignores them instead (:func:`ignored_until_exit`)."""
        if threading.current_thread() is not threading.main_thread():
            return
        unacted, cls._unacted = cls._unacted, []
        for signum in unacted:
            signal.raise_signal(signum)

    @classmethod
    def start_command(cls) -> None:
        """A new command of this process: nothing noted yet, and a store key of its own."""
        cls.sigterm = cls.requeue = cls.ctrl_c = cls.told_others = False
        cls._unacted = []
        cls.started = True
        cls.generation += 1

    @classmethod
    def start_slurm_command(cls) -> None:
        """A command line's command starts: on SLURM, SLURM's requeue signal (SIGUSR1, as ``#SBATCH
        --signal=SIGUSR1@90`` sends it) is noted from now on, before the command's set-up (building the model,
        listing the data), which may take minutes. Its default action would end the process at once, without the
        requeue. The command acts on it at its first batch boundary. SIGTERM keeps its default action until then:
        there is nothing to save yet, and a set-up that went on could outlast the scheduler's grace period."""
        cls.start_command()
        if on_slurm():
            cls.take(signal.SIGUSR1, sigterm=False)

    @classmethod
    def not_the_requeue_signal(cls, signum: int) -> None:
        """``signum``, noted as SLURM's requeue signal since :meth:`start_slurm_command`, is not this command's
        (auto-requeue off, or another signal configured): its earlier handler is back, and its note is dropped."""
        if threading.current_thread() is not threading.main_thread() or signum not in cls._previous:
            return
        previous = cls._previous.pop(signum)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        cls.requeue = False

    @classmethod
    def noted(cls) -> bool:
        return cls.sigterm or cls.requeue or cls.ctrl_c


def on_slurm() -> bool:
    """Whether this process is a SLURM job's (or job step's) task, by SLURMEnvironment.detect()'s rule, without the
    warning about srun that Lightning prints outside SLURM."""
    return "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")


class ToolStopped(BaseException):
    """A tool command (``shards``, ``export``, ...) stopped by SIGTERM or, on SLURM, by SLURM's requeue signal.
    These commands have no batch boundary to wait for: the exception is raised wherever the process is, as Ctrl-C
    raises KeyboardInterrupt, so that the command's clean-ups run (what they write is atomic or resumable). A
    BaseException, so that no ``except Exception`` takes it for an error."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def ignored_until_exit() -> None:
    """SIGTERM is ignored from now on, in a process that only exits: its command has ended. A SIGTERM then would
    cut short what is left (the end of the W&B run, a sweep's record of the cell, the wait for the other ranks,
    the clean-ups at exit) and, after a stop, turn the exit status 143 into a death by signal. SLURM sends one
    after a requeue, and srun sends one to the tasks left once one has exited."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


@contextmanager
def tool_stops_on_job_signals(process_exits: bool = False) -> Iterator[None]:
    """Within the block, SIGTERM and (on SLURM) SLURM's requeue signal raise :class:`ToolStopped`. Their default
    actions would end the process at once, without its clean-ups; the requeue signal's would not requeue the job
    either. After the first, both are ignored until the block ends, so that the clean-ups and whatever the block
    does about the stop (a requeue, after which SLURM sends SIGTERM) finish. Where the process exits after the
    block (``process_exits``), the block leaves them ignored, stopped or not (:func:`ignored_until_exit`).
    Otherwise a signal that comes while the block's end gives the earlier handlers back goes to the earlier
    handler. Outside the main thread, nothing changes (Python sets handlers there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    signums = [signal.SIGTERM, *([signal.SIGUSR1] if on_slurm() else [])]
    ended = False

    def stop(signum: int, frame: FrameType | None) -> None:
        if ended:
            earlier = previous[signal.Signals(signum)]
            signal.signal(signum, earlier if earlier is not None else signal.SIG_DFL)
            signal.raise_signal(signum)
            return
        for other in signums:
            signal.signal(other, signal.SIG_IGN)
        if _noted_in_pool is not None:
            _noted_in_pool.append(signum)  # raised by pool_map at its next result
            return
        raise ToolStopped(signum)

    previous = {signum: signal.signal(signum, stop) for signum in signums}
    try:
        yield
    finally:
        ended = True
        for signum, handler in previous.items():
            if process_exits:
                signal.signal(signum, signal.SIG_IGN)
            else:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


# Within pool_map: the tool's stop and Ctrl-C noted there, which it raises between two results. None elsewhere.
_noted_in_pool: list[int] | None = None


def pool_map(
    function: Callable[..., Result], tasks: list[tuple[Any, ...]], workers: int, done: Callable[[], object]
) -> list[Result]:
    """``function(*task)`` for each task, in the tasks' order, from a :func:`process_pool` of at most ``workers``
    processes; ``done`` is called as each task finishes.

    While the pool runs, a tool command's stop (:func:`tool_stops_on_job_signals`) and Ctrl-C are noted, then
    raised between two results. Raised wherever they land, they could land inside concurrent.futures' own code: its
    wait takes every future's lock in turn, an exception there leaves some of them held, and the pool's shutdown
    then waits for ever for its management thread, which needs one of those locks to cancel or finish a future."""
    global _noted_in_pool
    # Signals run their handlers in the main thread only: elsewhere there is nothing to defer.
    in_main_thread = threading.current_thread() is threading.main_thread()
    noted: list[int] = []
    if in_main_thread:
        _noted_in_pool = noted
    takes_ctrl_c = in_main_thread and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if takes_ctrl_c:
        signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    results: dict[int, Result] = {}
    try:
        with process_pool(min(workers, len(tasks))) as pool:
            futures = {pool.submit(function, *task): index for index, task in enumerate(tasks)}
            pending = set(futures)
            try:
                while pending:
                    # The timeout lets a noted signal out while a long task runs.
                    finished, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
                    for future in finished:
                        results[futures[future]] = future.result()  # a task's error is raised here
                        done()
                    _raise_noted(noted)
            except BaseException:
                pool.shutdown(cancel_futures=True)
                raise
        _raise_noted(noted)  # noted during the pool's shutdown
    finally:
        if in_main_thread:
            _noted_in_pool = None
        if takes_ctrl_c:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    return [results[index] for index in range(len(tasks))]


def _raise_noted(noted: list[int]) -> None:
    if noted:
        if noted[0] == signal.SIGINT:
            raise KeyboardInterrupt
        raise ToolStopped(noted[0])


def process_pool(max_workers: int) -> ProcessPoolExecutor:
    """A process pool whose workers end with this process (:func:`end_with_parent`) and leave the job's signals to
    it. On Linux its workers are forked, as Python before 3.14 forks them by default: a forked worker ignores the
    job's signals after :func:`shield_forked_children`, and its parent is this process (a forkserver's are not)."""
    context = multiprocessing.get_context("fork") if sys.platform.startswith("linux") else None
    return ProcessPoolExecutor(
        max_workers=max_workers, mp_context=context, initializer=end_with_parent, initargs=(os.getpid(),)
    )


def _store() -> Any:
    """The key-value store of the default process group, where ranks tell each other of a stop; None in one
    process or where there is none."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _stop_key() -> str:
    return f"robust_lightning/stop/{JobSignals.generation}"


def stop_requested() -> bool:
    """Whether this command should stop at this batch boundary: this process noted a signal, or another rank did
    (the store's key). A process that noted one puts the key there once. No collective: the ranks may be at
    different batches."""
    store = _store()
    if JobSignals.noted():
        if store is not None and not JobSignals.told_others:
            with suppress(Exception):  # the key only speeds the others up: the agreement decides
                store.set(_stop_key(), "1")
            JobSignals.told_others = True
        return True
    if store is None:
        return False
    try:
        return bool(store.check([_stop_key()]))
    except Exception:  # noqa: BLE001 (the agreement at the loop's end decides all the same)
        return False


def agree_to_stop(where: str) -> JobStopped | None:
    """The stop that every rank agrees on at this point, or None to go on. Under DDP a collective: each rank calls
    it once at the end of a loop (or at a batch boundary where it stops), and the largest of the ranks' notes
    decides, so they all stop at the same point. ``where`` names the work that stops (see :class:`JobStopped`)."""
    sigterm, requeue, ctrl_c = JobSignals.sigterm, JobSignals.requeue, JobSignals.ctrl_c
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # NCCL reduces tensors on this process's GPU only
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else "cpu"
        flags = torch.tensor([int(sigterm), int(requeue), int(ctrl_c)], device=device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        sigterm, requeue, ctrl_c = (bool(flag) for flag in flags.tolist())
    if not (sigterm or requeue or ctrl_c):
        return None
    JobSignals._unacted = []  # the command stops on them
    # a job's signal wins over Ctrl-C: SLURM's requeue must be done, and SLURM reads 143 as a stop
    return JobStopped(requeue=requeue, where=where, ctrl_c=not (sigterm or requeue))
