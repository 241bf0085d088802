"""A real single-node SLURM cluster for the tests: munged, slurmctld and slurmd on this host, all state in a temp dir.

The Debian packages (slurmctld, slurmd, munge) are installed when missing (CI runs as root on a fresh Debian
machine with the package registries). Everything else lives under one directory: the munge key and socket, a
slurm.conf for the local host on free ports, spool and state directories, daemon logs. No cgroups (containers
lack them): proctrack/linuxproc, task/none. Daemons run in the foreground as our own child processes and are
stopped by their process ids.

Usable by hand too:  python tests/slurm_cluster.py /tmp/cluster   (starts it, prints the environment, waits).
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from lightning import Callback

from robust_lightning.job_signals import JobSignals

PACKAGES = ("slurmctld", "slurmd", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "sinfo", "scontrol", "scancel")
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
}


class ClusterUnavailable(Exception):
    """SLURM cannot run here; the message says exactly why (the tests skip with it)."""


def _missing_binaries() -> list[str]:
    return [b for b in BINARIES if not shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")]


def install_packages(timeout: float = 600) -> None:
    """apt-get install the packages when a binary is missing; ClusterUnavailable when that is impossible."""
    if not _missing_binaries():
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise ClusterUnavailable(
            f"SLURM binaries missing ({', '.join(_missing_binaries())}) and they cannot be "
            "installed here (needs root and apt-get: apt-get install slurmctld slurmd munge)"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    log = []
    # a fresh machine may have no package lists yet: update once, then try again
    for attempt in (command, ["apt-get", "update"], command):
        try:
            done = subprocess.run(attempt, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            raise ClusterUnavailable(f"{' '.join(attempt)} took longer than {timeout:.0f} s") from None
        log.append(f"$ {' '.join(attempt)} -> {done.returncode}\n{done.stdout[-1500:]}{done.stderr[-1500:]}")
        if attempt is command and done.returncode == 0:
            break
    if _missing_binaries():
        raise ClusterUnavailable("could not install the SLURM packages:\n" + "\n".join(log)[-3000:])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _first_job_id() -> int:
    """Lightning's SLURM environment takes a job's DDP port from its id (15000 plus the id's last four digits), so
    two clusters on one host, one per pytest-xdist worker, would start their jobs on the same port. Each worker's
    cluster numbers its jobs from its own thousand."""
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    return 1000 * (1 + worker % 9)


def _die_with_parent() -> None:
    """Runs in the daemon before exec: it gets SIGTERM when the test process dies, even without a teardown."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def _sbin(name: str) -> str:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") or name


class SlurmCluster:
    """One partition ``debug`` with one node (this host) of ``cpus`` CPUs, requeue enabled."""

    def __init__(self, root: Path, cpus: int = 4):
        self.root = Path(root)
        self.cpus = cpus
        self.node = socket.gethostname().split(".")[0]
        self.conf = self.root / "etc" / "slurm.conf"
        self.processes: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------------------------------------ set-up
    @property
    def env(self) -> dict[str, str]:
        """The environment for SLURM client commands (sbatch, srun, squeue, ...) of this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def _write_config(self) -> None:
        r = self.root
        for sub in ("etc", "munge", "ctld", "spool", "log"):
            (r / sub).mkdir(parents=True, exist_ok=True)
            os.chmod(r / sub, 0o700)
        (r / "munge" / "munge.key").write_bytes(os.urandom(1024))
        os.chmod(r / "munge" / "munge.key", 0o600)
        self.munge_socket = r / "munge" / "munge.socket"
        self.conf.write_text(
            "\n".join(
                [
                    "ClusterName=rltest",
                    f"SlurmctldHost={self.node}(127.0.0.1)",
                    f"SlurmctldPort={_free_port()}",
                    f"SlurmdPort={_free_port()}",
                    "SlurmUser=root",
                    "SlurmdUser=root",
                    "AuthType=auth/munge",
                    "CredType=cred/munge",
                    f"AuthInfo=socket={self.munge_socket}",
                    f"StateSaveLocation={r / 'ctld'}",
                    f"SlurmdSpoolDir={r / 'spool'}",
                    f"SlurmctldPidFile={r / 'ctld' / 'slurmctld.pid'}",
                    f"SlurmdPidFile={r / 'spool' / 'slurmd.pid'}",
                    f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
                    f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
                    "SlurmctldDebug=info",
                    "SlurmdDebug=info",
                    # containers have no usable cgroups: track processes by parent id, bind nothing
                    "ProctrackType=proctrack/linuxproc",
                    "TaskPlugin=task/none",
                    "JobAcctGatherType=jobacct_gather/none",
                    "AccountingStorageType=accounting_storage/none",
                    "JobCompType=jobcomp/none",
                    "MpiDefault=none",
                    "SwitchType=switch/none",
                    "SchedulerType=sched/builtin",
                    "SelectType=select/cons_tres",
                    "SelectTypeParameters=CR_CPU",
                    # declare the node as configured, whatever the machine reports (2 cores in CI)
                    "SlurmdParameters=config_overrides",
                    "ReturnToService=2",
                    "JobRequeue=1",
                    f"FirstJobId={_first_job_id()}",
                    "KillWait=5",
                    "MinJobAge=600",
                    "SlurmctldTimeout=30",
                    "SlurmdTimeout=30",
                    "InactiveLimit=0",
                    "MessageTimeout=20",
                    f"PlugStackConfig={r / 'etc' / 'plugstack.conf'}",  # no SPANK plugins from /etc/slurm
                    f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory=4000 State=UNKNOWN",
                    f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
                    "",
                ]
            )
        )
        (r / "etc" / "plugstack.conf").write_text("")

    def _spawn(self, name: str, command: list[str]) -> None:
        with open(self.root / "log" / f"{name}.out", "w") as log:  # the daemon keeps its own descriptor
            self.processes[name] = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def _log_tail(self, name: str, chars: int = 1500) -> str:
        text = ""
        for path in (self.root / "log" / f"{name}.out", self.root / "log" / f"{name}.log"):
            if path.is_file():
                text += path.read_text(errors="replace")[-chars:]
        return text

    def _check_alive(self, name: str) -> None:
        process = self.processes[name]
        if process.poll() is not None:
            raise ClusterUnavailable(
                f"{name} exited with status {process.returncode} at start:\n{self._log_tail(name)}"
            )

    def start(self, timeout: float = 60) -> "SlurmCluster":
        install_packages()
        self._write_config()
        r = self.root
        self._spawn(
            "munged",
            [
                _sbin("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={r / 'munge' / 'munge.key'}",
                f"--pid-file={r / 'munge' / 'munged.pid'}",
                f"--log-file={r / 'log' / 'munged.log'}",
                f"--seed-file={r / 'munge' / 'seed'}",
            ],
        )
        deadline = time.time() + timeout
        while not self.munge_socket.exists():
            self._check_alive("munged")
            if time.time() > deadline:
                raise ClusterUnavailable(f"munged did not open its socket:\n{self._log_tail('munged')}")
            time.sleep(0.1)
        # -i: ignore state from earlier runs (there is none in a fresh dir anyway)
        self._spawn("slurmctld", [_sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [_sbin("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])
        while True:
            for name in ("slurmctld", "slurmd"):
                self._check_alive(name)
            state = self.node_state()
            if state.startswith("IDLE"):
                return self
            if time.time() > deadline:
                raise ClusterUnavailable(
                    f"node {self.node} not idle after {timeout:.0f} s (state {state!r}):\n"
                    f"{self._log_tail('slurmctld')}\n{self._log_tail('slurmd')}"
                )
            time.sleep(0.5)

    def node_state(self) -> str:
        out = subprocess.run(
            ["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=self.env, timeout=30
        )
        return out.stdout.strip().upper() if out.returncode == 0 else ""

    def stop(self) -> None:
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            subprocess.run(
                ["scancel", "--full", "--quiet", "--partition", "debug"], env=self.env, capture_output=True, timeout=30
            )
            # cancelled jobs' steps end within KillWait; give them that long before the daemons go
            deadline = time.time() + 15
            while time.time() < deadline and self.queue():
                time.sleep(0.5)
        for name in ("slurmd", "slurmctld", "munged"):
            process = self.processes.pop(name, None)
            if process is None or process.poll() is not None:
                continue
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)

    # -------------------------------------------------------------------------------------------- jobs
    def run(self, *command: str, timeout: float = 60, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        done = subprocess.run(
            list(command),
            capture_output=True,
            text=True,
            env={**self.env, **kwargs.pop("env", {})},
            timeout=timeout,
            **kwargs,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"{' '.join(command)} failed ({done.returncode}): {done.stderr}{done.stdout}")
        return done

    def queue(self) -> list[str]:
        out = self.run("squeue", "-h", "-r", "-o", "%i %T", check=False)
        return out.stdout.split("\n") if out.stdout.strip() else []

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, StdOut, ...); {} once forgotten."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        fields = {}
        for line in out.stdout.splitlines()[:1]:
            for item in line.split():
                key, _, value = item.partition("=")
                fields[key] = value
        return fields

    def jobs(self, job_id: str) -> list[dict[str, str]]:
        """All records of a job (one per array task)."""
        out = self.run("scontrol", "-o", "show", "job", str(job_id), check=False)
        records = []
        for line in out.stdout.splitlines():
            records.append(dict(item.partition("=")[::2] for item in line.split()))
        return records

    def wait(self, job_id: str, timeout: float = 300) -> list[dict[str, str]]:
        """Wait until every task of the job has finished; returns their records."""
        deadline = time.time() + timeout
        while True:
            records = self.jobs(job_id)
            if records and all(r.get("JobState") in FINISHED for r in records):
                return records
            if time.time() > deadline:
                raise AssertionError(
                    f"job {job_id} not finished after {timeout:.0f} s: "
                    f"{[(r.get('JobId'), r.get('JobState')) for r in records]}\n{self.queue()}"
                )
            time.sleep(1)


HOLD_LIMIT = 120  # seconds that Pace holds a job for a test's signal before it fails the job


class Pace(Callback):
    """Slows training down to ``seconds`` per batch, and a validation to ``validation_seconds`` per batch (so a
    test can signal a job mid-run), and appends every trained batch (SLURM attempt, epoch, global step) and every
    validation batch started (with "validation": its index) to the file ``record`` where it paces or holds one.

    With ``hold_at`` (a record's point, such as ``{"step": 2}`` or ``{"validation": 0}``), each rank of the first
    attempt stops there, after the record, until the test's signal has reached it. So the signal lands at that point
    however slowly scancel, slurmctld and slurmstepd pass it on, and the command's own check for it comes next (the
    config's callbacks run before the command's)."""

    def __init__(self, record: str, seconds: float = 0.5, validation_seconds: float = 0.0, hold_at: dict | None = None):
        self.record, self.seconds, self.validation_seconds, self.hold_at = record, seconds, validation_seconds, hold_at

    def _note(self, trainer, **point) -> None:
        attempt = int(os.environ.get("SLURM_RESTART_COUNT", 0))
        if trainer.is_global_zero:
            with open(self.record, "a") as f:
                f.write(json.dumps({"attempt": attempt, "epoch": trainer.current_epoch, **point}) + "\n")
        if point == self.hold_at and attempt == 0:
            deadline = time.monotonic() + HOLD_LIMIT
            while not JobSignals.noted():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"Pace held the job at {point} for {HOLD_LIMIT} s, and no signal came")
                time.sleep(0.05)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        time.sleep(self.seconds)
        self._note(trainer, step=trainer.global_step)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking and (self.validation_seconds or "validation" in (self.hold_at or {})):
            self._note(trainer, validation=batch_idx)
            time.sleep(self.validation_seconds)


class SignalMidStep(Callback):
    """Sends ``signal_name`` to this process inside the training step that makes optimiser step ``step`` (after
    its backward pass, before the optimiser updates the weights)."""

    def __init__(self, step: int, signal_name: str = "SIGUSR1"):
        self.step, self.signum = step, signal.Signals[signal_name]

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step + 1 == self.step:
            os.kill(os.getpid(), self.signum)


class SignalInSetup(Callback):
    """Sends ``signal_name`` to this process in the command's set-up: in this callback's setup hook, which runs
    before those of the callbacks the command line adds (Interruption's among them)."""

    def __init__(self, signal_name: str = "SIGUSR1"):
        self.signum = signal.Signals[signal_name]

    def setup(self, trainer, pl_module, stage: str) -> None:
        os.kill(os.getpid(), self.signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # kill PID: cancel the jobs and stop the daemons
    cluster = SlurmCluster(Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/rl-slurm"))
    try:
        cluster.start()
        print(f"cluster up: export SLURM_CONF={cluster.conf}", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
