"""Errors in a cluster log (issue 37), as users meet them: ``python -m robust_lightning`` in subprocesses.

- Under srun or torchrun every process of the job parses the config: an error in it is printed once for the job, by
  its rank 0, and names ``robust-lightning`` (not ``__main__.py``); every process exits with status 2.
- A combination of Trainer options that Lightning refuses while the Trainer is built is one message and exit 2; an
  error raised while training keeps its traceback.
- One rank's error in a DDP job is the job's one error, with nothing after it but one line saying that the other
  rank stopped, soon, whether that rank meets the failure in a collective or waits where it never would. After a
  stop by SIGTERM the ranks leave together (robust_lightning.rank_exit).
- A W&B fit whose output is not a terminal writes W&B's closing lines without colour codes.
"""

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from lightning import Callback
from torch.distributed import TCPStore

from helpers import REPO, run_command, synthetic_source, tiny_config
from robust_lightning import errors, rank_exit
from robust_lightning.errors import UserError, job_rank, print_error, print_rank_error

TASKS = 2  # rank 0, which prints, and another, which must not: a third rank would be the second again
TIMEOUT = 120  # seconds for a command that stops at its config (a few at once on shared cores)


class FailsWhileTraining(Callback):
    """A ValueError raised in the middle of a fit: not a Trainer-construction error, so its traceback stays."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        raise ValueError("a fault while training")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def srun_task(rank: int) -> dict[str, str]:
    """What srun gives task ``rank`` of a one-node, TASKS-task step."""
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_LOCALID": str(rank),
        "SLURM_NODEID": "0",
        "SLURM_NTASKS": str(TASKS),
        "SLURM_NTASKS_PER_NODE": str(TASKS),
        "SLURM_NNODES": "1",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "robust-lightning-test",
    }


def torchrun_worker(rank: int, port: int) -> dict[str, str]:
    """What torchrun gives worker ``rank`` of a one-node, TASKS-worker job."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(TASKS),
        "LOCAL_WORLD_SIZE": str(TASKS),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def run_job(args: list[str], environments: list[dict[str, str]], cwd: Path) -> list:
    """The command started at once in every process of the job (one environment each), as the launcher does."""
    with ThreadPoolExecutor(len(environments)) as pool:
        runs = [pool.submit(run_command, args, cwd=cwd, timeout=TIMEOUT, env=env) for env in environments]
        return [run.result() for run in runs]


def job_environments(launcher: str) -> list[dict[str, str]]:
    port = free_port()
    return [srun_task(rank) if launcher == "srun" else torchrun_worker(rank, port) for rank in range(TASKS)]


def bad_configs(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Configs with an error (tiny_config's, so that only the error stops them), and a word of its message."""
    config = yaml.safe_load(tiny_config(tmp_path, **{"model.arch": "test_resnet"}).read_text())
    key = yaml.safe_load(yaml.safe_dump(config))
    key["model"]["not_an_option"] = 1
    value = yaml.safe_load(yaml.safe_dump(config))
    value["trainer"]["max_epochs"] = "three"
    files = {}
    for name, content, word in (("key", key, "not_an_option"), ("value", value, "max_epochs")):
        path = tmp_path / f"bad-{name}.yaml"
        path.write_text(yaml.safe_dump(content))
        files[name] = (path, word)
    empty = tmp_path / "empty.yaml"  # a UserError of the command (robust_lightning.cli.check_config_files)
    empty.write_text("")
    files["empty"] = (empty, "is empty")
    return files


# each error once and each launcher at least once: which launcher started the processes does not change how the
# config is parsed, only how the job's rank 0 is found
@pytest.mark.parametrize("launcher, error", [("srun", "key"), ("srun", "empty"), ("torchrun", "value")])
def test_an_error_in_the_config_is_printed_once_per_job_naming_robust_lightning(tmp_path, launcher, error):
    config, word = bad_configs(tmp_path)[error]
    runs = run_job(["fit", "--config", str(config)], job_environments(launcher), tmp_path)
    assert [run.returncode for run in runs] == [2] * TASKS, [run.stderr[-2000:] for run in runs]
    assert [rank for rank, run in enumerate(runs) if word in run.stderr] == [0], [run.stderr[-2000:] for run in runs]
    error_lines = [line for line in runs[0].stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and error_lines[0].startswith("robust-lightning"), runs[0].stderr
    for run in runs:
        assert "__main__.py" not in run.stderr + run.stdout, run.stderr
        assert "Traceback" not in run.stderr, run.stderr
    for run in runs[1:]:  # the other ranks exit silently
        assert "error" not in run.stderr.lower(), run.stderr


def test_a_process_started_alone_still_prints_its_error(tmp_path):
    config, word = bad_configs(tmp_path)["key"]
    run = run_command(["fit", "--config", str(config)], cwd=tmp_path, timeout=TIMEOUT)
    assert run.returncode == 2, run.stderr
    assert run.stderr.startswith(f"robust-lightning fit: error: Subcommand 'fit' does not accept option 'model.{word}'")
    assert "options: robust-lightning fit --help" in run.stderr


TRAINER_REFUSES = ["--trainer.strategy", "fsdp", "--trainer.accelerator", "cpu"]  # FSDP needs GPUs


def test_an_option_combination_the_trainer_refuses_is_one_message_and_exit_2(tmp_path):
    config = tiny_config(tmp_path, **{"model.arch": "test_resnet"})
    run = run_command(["fit", "--config", str(config), *TRAINER_REFUSES], cwd=tmp_path, timeout=TIMEOUT)
    assert run.returncode == 2, run.stderr
    assert "Traceback" not in run.stderr, run.stderr
    [line] = [line for line in run.stderr.splitlines() if "error:" in line]
    assert line.startswith("robust-lightning: error: --trainer.strategy fsdp, --trainer.accelerator cpu: "), line
    assert "requires a GPU accelerator" in line
    assert not (tmp_path / "runs" / "tiny").exists()  # refused before any run directory


def test_under_srun_the_trainer_s_refusal_is_printed_once_per_job(tmp_path):
    """Each task builds its Trainer and meets the same refusal."""
    config = tiny_config(tmp_path, **{"model.arch": "test_resnet"})
    runs = run_job(["fit", "--config", str(config), *TRAINER_REFUSES], job_environments("srun"), tmp_path)
    assert [run.returncode for run in runs] == [2] * TASKS, [run.stderr[-2000:] for run in runs]
    assert [rank for rank, run in enumerate(runs) if "robust-lightning: error: " in run.stderr] == [0]
    assert not any("Traceback" in run.stderr for run in runs), [run.stderr[-2000:] for run in runs]


def test_an_error_raised_while_training_keeps_its_traceback(tmp_path):
    callback = {"class_path": f"{__name__}.FailsWhileTraining"}  # tests/ is on the commands' PYTHONPATH
    config = tiny_config(tmp_path, **{"model.arch": "test_resnet", "trainer.callbacks": [callback]})
    run = run_command(["fit", "--config", str(config)], cwd=tmp_path, timeout=TIMEOUT)
    assert run.returncode == 1, run.stderr
    assert "Traceback" in run.stderr and "ValueError: a fault while training" in run.stderr, run.stderr[-3000:]


def test_a_w_and_b_fit_writes_no_colour_codes_into_a_log(tmp_path):
    config = tiny_config(tmp_path, **{"model.arch": "test_resnet"})
    wandb_config = str(REPO / "configs" / "loggers" / "wandb.yaml")  # writes to ./runs: tmp_path here
    env = {
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path),
        "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
        "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
        "WANDB_DATA_DIR": str(tmp_path / "wandb-data"),
        "WANDB_DISABLE_GIT": "true",
    }
    run = run_command(["fit", "--config", str(config), "--config", wandb_config], cwd=tmp_path, timeout=240, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    output = run.stdout + run.stderr
    assert "wandb sync" in output, output[-3000:]  # W&B's closing lines are there
    assert "\x1b[" not in output, [line for line in output.splitlines() if "\x1b[" in line]
    [run_file] = (tmp_path / "runs" / "wandb").glob("offline-run-*/run-*.wandb")
    assert run_file.stat().st_size > 0


def test_the_job_rank_comes_from_the_launcher(monkeypatch, capsys):
    for name in ("RANK", "SLURM_PROCID", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    assert job_rank() == 0
    monkeypatch.setenv("SLURM_PROCID", "2")
    monkeypatch.setenv("SLURM_NTASKS", "1")  # a one-task step (the batch script): every process is on its own
    assert job_rank() == 0
    monkeypatch.setenv("SLURM_NTASKS", "4")
    assert job_rank() == 2
    monkeypatch.setenv("RANK", "0")  # torchrun's global rank wins over the srun task it runs in
    assert job_rank() == 0
    monkeypatch.setenv("RANK", "5")
    print_error("not this rank")
    print_error("a rank's own error", every_rank=True)
    assert capsys.readouterr().err == "robust-lightning: error: a rank's own error\n"


class RefusesInSetup(Callback):
    """A UserError met after the Trainer is built, in the set-up of every rank or of one (``rank``), as a data
    module meets a value it refuses or one rank a file it cannot read."""

    def __init__(self, rank: int | None = None):
        self.rank = rank

    def setup(self, trainer, pl_module, stage):
        if self.rank is None or trainer.global_rank == self.rank:
            raise UserError(f"a value refused in set-up (on {'every rank' if self.rank is None else 'one rank'})")


def ddp_fit_refused_in_setup(tmp_path: Path, rank: int | None):
    callback = {"class_path": f"{__name__}.RefusesInSetup", "init_args": {"rank": rank}}
    ddp = {"trainer.devices": 2, "trainer.strategy": "ddp", "trainer.callbacks": [callback]}
    # a user's defaults, which tiny_config switches off: the progress display and loader workers
    defaults = {"trainer.enable_progress_bar": True, "data.num_workers": 2}
    config = tiny_config(tmp_path, **{"model.arch": "test_resnet", **ddp, **defaults})
    return run_command(["fit", "--config", str(config)], cwd=tmp_path, timeout=TIMEOUT)


def test_an_error_every_ddp_rank_meets_after_the_trainer_is_built_is_printed_once(tmp_path):
    """Both ranks of a 2-process DDP fit (Lightning's launcher: they share the terminal) meet the same refusal."""
    run = ddp_fit_refused_in_setup(tmp_path, rank=None)
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert errors == ["robust-lightning: error: a value refused in set-up (on every rank)"], run.stderr[-3000:]
    assert not (tmp_path / "runs" / ".errors").exists()  # the ranks' shared notes are gone


def test_an_error_one_ddp_rank_meets_alone_is_printed_by_that_rank(tmp_path):
    run = ddp_fit_refused_in_setup(tmp_path, rank=1)
    assert run.returncode != 0
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    assert errors == ["robust-lightning: error: (rank 1) a value refused in set-up (on one rank)"], run.stderr[-3000:]


def test_rank_errors_are_filed_and_compared_without_a_collective(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MASTER_PORT", "29999")
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(errors, "RANK_ZERO_WAIT", 0.2)
    # three ranks meeting one error: rank 0 prints it, the others find the same and stay silent
    for rank in range(3):
        print_rank_error("the same error", rank, 3, tmp_path)
    assert capsys.readouterr().err == "robust-lightning: error: the same error\n"
    assert not (tmp_path / ".errors").exists()  # the last rank to decide removed the job's notes
    # a rank whose error differs from rank 0's, and one whose rank 0 filed nothing: each prints its own
    print_rank_error("rank 0's error", 0, 3, tmp_path)
    print_rank_error("rank 1's own error", 1, 3, tmp_path)
    assert capsys.readouterr().err.splitlines() == [
        "robust-lightning: error: rank 0's error",
        "robust-lightning: error: (rank 1) rank 1's own error",
    ]
    monkeypatch.setenv("MASTER_PORT", "29998")  # another job
    print_rank_error("rank 2's own error", 2, 3, tmp_path)
    assert capsys.readouterr().err == "robust-lightning: error: (rank 2) rank 2's own error\n"
    # a single process, or no folder every rank sees: printed as is
    print_rank_error("alone", 0, 1, tmp_path)
    print_rank_error("no shared folder", 1, 2, None)
    assert capsys.readouterr().err.splitlines() == [
        "robust-lightning: error: alone",
        "robust-lightning: error: no shared folder",
    ]


# ------------------------------------------------------------------ one error per job, and nothing after it
class FailsOnOneRank(Callback):
    """Rank ``rank`` alone fails at the start of training step ``step``: with a UserError, as a rank meets a file
    that it alone reads, or with another exception, whose traceback stays. It notes the time in ``record``. With
    ``block_others``, the other ranks then wait where no peer's exit reaches them, as in an NCCL collective that
    waits for its time-out."""

    def __init__(self, rank: int, record: str, step: int = 2, user_error: bool = True, block_others: bool = False):
        self.rank, self.record, self.step = rank, Path(record), step
        self.user_error, self.block_others = user_error, block_others

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step != self.step:
            return
        if trainer.global_rank == self.rank:
            self.record.write_text(str(time.time()))
            if self.user_error:
                raise UserError(f"a file only rank {self.rank} reads is corrupt")
            raise ValueError(f"a fault on rank {self.rank}")
        if self.block_others:
            time.sleep(600)


STOP_BOUND = 30  # seconds from the failure to the job's end: a few for the failed rank's message, a grace, the exits


def ddp_fit_failing_on_one_rank(tmp_path: Path, rank: int, **options):
    """A 2-rank gloo fit with a user's defaults (the progress display, a loader worker per rank) in which rank
    ``rank`` alone fails at step 2. Returns the run and how long after the failure the job ended."""
    record = tmp_path / "failed_at"
    options = {"rank": rank, "record": str(record), **options}
    callback = {"class_path": f"{__name__}.FailsOnOneRank", "init_args": options}
    config = tiny_config(
        tmp_path,
        **{
            "model.arch": "test_resnet",
            "trainer.devices": 2,
            "trainer.strategy": "ddp",
            "trainer.callbacks": [callback],
            "trainer.enable_progress_bar": True,
            "data.num_workers": 1,
            "data.source": synthetic_source(num_classes=4, train_per_class=16, val_per_class=4, image_size=32),
        },
    )
    run = run_command(["fit", "--config", str(config)], cwd=tmp_path, timeout=TIMEOUT)
    assert record.is_file(), run.stderr[-3000:]  # the fit got to the failure
    return run, time.time() - float(record.read_text())


def assert_nothing_after_the_error(run, last_line_of_error: str, stopped: str) -> None:
    """After the failed rank's error, one line alone: the one saying that the other rank stopped. Nowhere a rank's
    traceback from a collective, a line of gloo's or torch's distributed code (c10d), or Lightning's launcher
    killing the ranks."""
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    last = max(i for i, line in enumerate(lines) if line.endswith(last_line_of_error))
    assert lines[last + 1 :] == [stopped], run.stderr[-3000:]
    output = run.stderr + run.stdout
    assert [line for line in output.splitlines() if "gloo" in line.lower()] == ["distributed_backend=gloo"], output
    assert "Connection closed" not in output and "c10d" not in output, output[-3000:]
    assert "Child process" not in output and "Forcefully terminating" not in output, output[-3000:]


@pytest.mark.parametrize("rank", [1, 0])
def test_one_rank_s_error_in_training_is_the_job_s_one_error(tmp_path, rank):
    """The other rank, waiting for it in a collective, ends without a traceback of its own, soon."""
    run, took = ddp_fit_failing_on_one_rank(tmp_path, rank)
    assert run.returncode != 0
    assert took < STOP_BOUND, (took, run.stderr[-3000:])
    errors = [line for line in run.stderr.splitlines() if "error:" in line]
    message = f"a file only rank {rank} reads is corrupt"
    assert errors == [f"robust-lightning: error: {'(rank 1) ' if rank else ''}{message}"], run.stderr[-3000:]
    assert "Traceback" not in run.stderr + run.stdout, run.stderr[-3000:]
    stopped = f"robust-lightning: rank {1 - rank} stopped: rank {rank} failed (see its message above)"
    assert_nothing_after_the_error(run, errors[0], stopped)


def test_a_rank_that_never_meets_the_failure_is_stopped_all_the_same(tmp_path):
    """Rank 1 fails with a traceback while rank 0 waits where no connection error reaches it (an NCCL collective
    would wait 30 minutes for its time-out): rank 0 is stopped soon, and the traceback is the job's one error."""
    run, took = ddp_fit_failing_on_one_rank(tmp_path, 1, user_error=False, block_others=True)
    assert run.returncode != 0
    assert took < STOP_BOUND, (took, run.stderr[-3000:])
    assert run.stderr.count("Traceback") == 1 and "ValueError: a fault on rank 1" in run.stderr, run.stderr[-3000:]
    stopped = "robust-lightning: rank 0 stopped: rank 1 failed (see its message above)"
    assert_nothing_after_the_error(run, "ValueError: a fault on rank 1", stopped)


def test_the_ranks_of_a_stopped_job_leave_together():
    """At the end of a stop by SIGTERM no rank leaves before every rank has got there, and rank 0, which holds the
    store, leaves last. Three ranks on a real TCPStore, the second one second late."""
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    arrived, left, said_done = {}, {}, {}

    class NotingStore:
        """The rank's store, noting when the rank says that it asks the store nothing more: a thread's own time
        stamp after it returns can come late on a loaded machine, so "rank 0 leaves last" is checked against this."""

        def __init__(self, rank: int):
            self.rank, self.store = rank, TCPStore("127.0.0.1", server.port, is_master=False)

        def add(self, key: str, amount: int) -> int:
            if key == rank_exit.DONE and amount:
                said_done[self.rank] = time.monotonic()
            return self.store.add(key, amount)

        def __getattr__(self, name: str):
            return getattr(self.store, name)

    jobs = [rank_exit._Job(NotingStore(rank), rank, 3, False) for rank in range(3)]

    def leave(job):
        if job.rank == 1:
            time.sleep(1.0)
        arrived[job.rank] = time.monotonic()
        rank_exit._leave_together(job)
        left[job.rank] = time.monotonic()

    with ThreadPoolExecutor(3) as pool:
        list(pool.map(leave, jobs))
    assert min(left.values()) >= arrived[1]
    assert sorted(said_done) == [1, 2] and left[0] >= max(said_done.values())
    assert max(left.values()) - arrived[1] < 5.0  # then at once, not after LEAVE_WAIT (60 s); a loaded machine is slow
