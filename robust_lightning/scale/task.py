"""One cell of a sweep: ``python -m robust_lightning cell MANIFEST [INDEX]`` (INDEX: $SLURM_ARRAY_TASK_ID).

The array script of ``robust-lightning sweep`` runs this under srun, in every process (srun task) of an array
task. It runs the cell's ``robust-lightning`` command in this process (so SLURM's SIGUSR1 reaches Lightning's
requeue handler); the command line's entry point hands itself in as ``run``, so this module never imports it and records
the outcome in the ``sweep`` section of the cell's results.json: ``running`` at the start, then ``done``, ``failed`` or
``interrupted``. Only ``done`` counts as a result; anything else is retried by the next ``robust-lightning sweep`` and
listed by ``robust-lightning report``.
"""

import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from robust_lightning.argument_parsing import run_tool
from robust_lightning.errors import UserError
from robust_lightning.evaluation.results import ResultsFile
from robust_lightning.job_signals import EXIT_CTRL_C, EXIT_SIGTERM, shield_forked_children


def slurm_layout() -> list[str]:
    """trainer.devices / num_nodes from the allocation: Lightning requires devices == --ntasks-per-node and
    num_nodes == --nodes, whatever the config says (``devices: auto`` would take every GPU of the node)."""
    per_node = re.match(r"\d+", os.environ.get("SLURM_NTASKS_PER_NODE", ""))
    nodes = os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES")
    if not per_node or not nodes:
        return []
    return [f"--trainer.devices={per_node.group()}", f"--trainer.num_nodes={nodes}"]


def run_cell(manifest_path: str, index: int, run: Callable[[list[str]], int]) -> int:
    """Run cell ``index`` of the manifest with ``run`` (robust_lightning.cli.main) and record its outcome."""
    manifest = json.loads(Path(manifest_path).read_text())
    cell = manifest["cells"][index]
    os.chdir(manifest["workdir"])
    rank_zero = os.environ.get("SLURM_PROCID", "0") == "0"
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    log = os.environ.get("RL_SWEEP_LOG") or (
        manifest["log_pattern"].format(job=array, task=task) if array and task else None
    )
    record: dict[str, Any] = {
        "sweep": manifest["sweep"],
        "cell": cell["id"],
        "labels": cell["labels"],
        "values": cell["values"],
        "job": f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID"),
        "restarts": int(os.environ.get("SLURM_RESTART_COUNT", 0)),
        "log": log,
    }
    results = ResultsFile.of(cell["dir"])

    def mark(status: str, **extra: Any) -> None:
        if rank_zero:
            results.write(
                {"sweep": {**record, "status": status, **extra, "updated": time.strftime("%Y-%m-%dT%H:%M:%S")}}
            )

    if manifest.get("wandb"):  # read by every WandbLogger of the cell: one group and the same tags per sweep
        os.environ.setdefault("WANDB_RUN_GROUP", manifest["wandb"]["group"])
        os.environ.setdefault("WANDB_TAGS", ",".join(manifest["wandb"]["tags"]))
    argv = list(cell["argv"]) + slurm_layout()
    sys.argv = ["robust-lightning", *argv]  # what results.json records as the command
    mark("running")
    shield_forked_children()
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    # The first Ctrl-C stops the command at a batch boundary (status 130). A second one, or one before the command
    # takes the signals, raises KeyboardInterrupt, and Lightning ends the command with status 1, as an error
    # would: the cell is interrupted, not failed.
    ctrl_c: list[int] = []

    def note_ctrl_c(signum: int, frame: FrameType | None) -> None:
        ctrl_c.append(signum)
        raise KeyboardInterrupt

    in_main_thread = threading.current_thread() is threading.main_thread()  # where Python takes signals
    previous = signal.signal(signal.SIGINT, note_ctrl_c) if in_main_thread else None
    try:
        code = run(argv)
    except SIGTERMException:  # SLURM stopping the job (time limit, requeue, scancel): a retry resumes it
        mark("interrupted", error="SIGTERM")
        raise
    except SystemExit as e:  # the argument parser's exit, or Lightning's after Ctrl-C
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException as e:
        if ctrl_c or isinstance(e, KeyboardInterrupt):
            mark("interrupted", error="SIGINT (Ctrl-C)")
        else:
            mark("failed", error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if code == 0:
        mark("done", exit_code=0)
    elif ctrl_c or code == EXIT_CTRL_C:  # 130: the command line's status for a run stopped by Ctrl-C
        mark("interrupted", exit_code=code, error="SIGINT (Ctrl-C)")
    elif code == EXIT_SIGTERM:  # the command line's status for a run stopped by SIGTERM
        mark("interrupted", exit_code=code, error="SIGTERM")
    else:
        mark("failed", exit_code=code, error=f"robust-lightning exited with status {code}")
    return code


def cell_main(argv: list[str], run: Callable[[list[str]], int]) -> int:
    def cell(manifest: str, index: int | None = None) -> int:
        """Run one cell of a sweep's array job and record its outcome in the cell's results.json.

        Args:
            manifest: the array's manifest (<output_dir>/arrays/NNN.json, written by robust-lightning sweep)
            index: the cell's index in the manifest (default: $SLURM_ARRAY_TASK_ID)
        """
        if index is None:
            if not os.environ.get("SLURM_ARRAY_TASK_ID", "").isdigit():
                raise UserError("no cell index given and SLURM_ARRAY_TASK_ID is not set")
            index = int(os.environ["SLURM_ARRAY_TASK_ID"])
        return run_cell(manifest, index, run)

    return run_tool(
        cell,
        argv,
        prog="robust-lightning cell",
        description="Run cell INDEX of a sweep's array manifest (the sweep's array script does).",
    )
