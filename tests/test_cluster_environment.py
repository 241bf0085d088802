"""The suite run inside a cluster job: the job's launcher variables (SLURM's, torchrun's, its MASTER_PORT) must not
reach the tests' own fits, or the DDP tests running side by side would all meet on the job's port."""

import os
import signal
import socket
import subprocess
import sys

from helpers import REPO

DDP_TEST = "tests/test_ddp.py::test_ddp_validate_on_a_folder_counts_every_image_once"


def test_a_ddp_test_passes_with_the_jobs_port_taken_and_its_variables_set():
    with socket.socket() as taken:  # the job's rendezvous port, in use as it is in the job
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        job = {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(taken.getsockname()[1]),
            "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "train",
            "SLURM_NTASKS": "8",
            "SLURM_PROCID": "3",
            "SLURM_LOCALID": "3",
            "WORLD_SIZE": "8",
            "RANK": "3",
            "LOCAL_RANK": "3",
            "TORCHELASTIC_RUN_ID": "job",
        }
        process = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", DDP_TEST],
            cwd=REPO,
            env={**os.environ, **job},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # pytest and every rank it started
            output, _ = process.communicate()
            raise AssertionError(f"the DDP test did not end within 300 s:\n{output[-3000:]}") from None
    assert process.returncode == 0, output[-3000:]
    assert "1 passed" in output
