"""``robust-lightning sweep --config configs/sweeps/NAME.yaml``: a grid of runs as one SLURM array job.

A sweep file names a command and its base configs, fixed overrides, the grid axes and the SLURM resources::

    name: quickstart                 # default: the file name
    command: test                    # fit | validate | test
    configs: [configs/eval/quickstart_autoattack.yaml]   # composed left to right, as --config
    args: {data.eval_limit: 100}     # fixed overrides of every cell, as --key=value
    grid:                            # the cells are the product of the axes, in this order
      ckpt_path: {clean: runs/a/last.ckpt, at: runs/b/last.ckpt}   # labelled values of a config key
      data.image_size: [32, 48]                                     # values that label themselves
      benchmark:                     # an axis of named bundles: each adds config files and/or overrides
        clean: {args: {trainer.callbacks: []}}
        apgd_ce: {args: {trainer.callbacks.init_args.version: apgd-ce}}
    output_dir: runs/sweeps/quickstart   # default: runs/sweeps/<name>
    slurm: {partition: gpu, time: "04:00:00", gpus-per-node: 1, cpus-per-task: 8, max_parallel: 16,
            setup: "module load cuda"}   # sbatch options, plus max_parallel (array throttle) and setup lines
    wandb: {project: robust-lightning, tags: [paper]}   # optional: a WandbLogger per cell, one group per sweep

Every cell gets a stable id (the axis labels plus a hash of the values) and its own run directory
``<output_dir>/cells/<id>/``: default_root_dir, logger save_dir and checkpoint dirpath all point there, so
results.json, checkpoints, AutoAttack outcomes and SLURM's hpc_ckpt_N.ckpt never mix between cells. A cell is
done when its results.json holds a ``sweep`` section with status ``done`` (written by ``robust-lightning cell``,
robust_lightning.scale.task, after the command succeeded); re-running the sweep submits only the cells that are
neither done nor still in the queue, so a failed or interrupted cell is retried and a finished one never redone.
Before anything is written, submitted or printed (``--dry_run`` too), every cell's command line is parsed as its
task will parse it: a misspelt key or a bad value stops the sweep with one message naming the cell.

The sweep file is the config file of the ``sweep`` command: ``--config FILE`` reads it (several compose left to
right), ``--print_config`` prints the composed sweep, and any key can be set on the command line
(``--output_dir DIR``, ``--dry_run``, ``--local``).
"""

import getpass
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from robust_lightning.argument_parsing import parse_tool_arguments
from robust_lightning.atomic import atomic_write_json
from robust_lightning.errors import UserError, user_command
from robust_lightning.scale.sweep_spec import Cell, Sweep, expand, sweep_from_spec

# every cell of an array gets the same resources; requeue + SIGUSR1@90 let Lightning save hpc_ckpt_N.ckpt in the
# cell's directory and requeue before the time limit (a resumed fit continues from it, AutoAttack from its outcomes)
SBATCH_DEFAULTS = {"nodes": 1, "ntasks-per-node": 1, "requeue": True, "signal": "SIGUSR1@90", "open-mode": "append"}
SLURM_EXTRA = ("max_parallel", "setup")


def cell_status(cell_dir: Path) -> dict[str, Any]:
    """The ``sweep`` section of a cell's results.json ({} when the cell never started)."""
    path = Path(cell_dir) / "results.json"
    try:
        content = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}
    status = content.get("sweep") if isinstance(content, dict) else None
    return status if isinstance(status, dict) else {}


def cell_state(cell_dir: Path) -> str:
    """done | failed | interrupted | running | missing."""
    status: str = cell_status(cell_dir).get("status", "missing")
    return status


# --------------------------------------------------------------------------------------------- the queue
def _submissions(output_dir: Path) -> list[dict[str, Any]]:
    path = output_dir / "submissions.json"
    return json.loads(path.read_text()) if path.is_file() else []


def queued_cells(output_dir: Path) -> dict[str, str]:
    """Cells of earlier submissions that are still pending or running in SLURM: cell id -> SLURM state."""
    submissions = _submissions(output_dir)
    if not submissions or not shutil.which("squeue"):
        return {}
    out = subprocess.run(
        ["squeue", "-h", "-r", "-u", getpass.getuser(), "-o", "%F %K %T"], capture_output=True, text=True, timeout=60
    )
    if out.returncode != 0:
        raise UserError(f"squeue failed, cannot tell which cells are still queued: {out.stderr.strip()}")
    active = {}
    for line in out.stdout.splitlines():
        parts = line.split()
        if len(parts) == 3:
            active[(parts[0], parts[1])] = parts[2]
    queued = {}
    for submission in submissions:
        for index, cell_id in enumerate(submission["cells"]):
            state = active.get((str(submission["job_id"]), str(index)))
            if state:
                queued[cell_id] = state
    return queued


# ---------------------------------------------------------------------------------------- the array job
def _sbatch_lines(sweep: Sweep, count: int) -> list[str]:
    options = {"job-name": f"rl-{sweep.name}", **SBATCH_DEFAULTS}
    for key, value in sweep.slurm.items():
        if key not in SLURM_EXTRA:
            options[str(key).replace("_", "-")] = value
    throttle = sweep.slurm.get("max_parallel")
    options["array"] = f"0-{count - 1}" + (f"%{int(throttle)}" if throttle else "")
    options["output"] = str(sweep.output_dir / "logs" / "%A_%a.out")
    lines = []
    for key, value in options.items():
        if value is True:
            lines.append(f"#SBATCH --{key}")
        elif value not in (None, False):
            lines.append(f"#SBATCH --{key}={value}")
    return lines


def array_script(sweep: Sweep, cells: list[Cell], manifest: Path) -> str:
    setup = sweep.slurm.get("setup") or []
    setup = setup.splitlines() if isinstance(setup, str) else [str(s) for s in setup]
    lines = [
        "#!/bin/bash",
        f"# robust-lightning sweep {sweep.name!r}: {len(cells)} cell(s) of `{sweep.command}`, one array task each.",
        f"# Task i runs cell i of {manifest.name} (beside this script) in its own run directory",
        f"# {sweep.output_dir}/cells/<cell id>/; merge the results with: robust-lightning report {sweep.output_dir}",
        *_sbatch_lines(sweep, len(cells)),
        "",
        "set -euo pipefail",
        f"cd {shlex.quote(str(sweep.workdir))}",
        "# compute nodes rarely reach W&B: log offline, upload later with `wandb sync`",
        'export WANDB_MODE="${WANDB_MODE:-offline}"',
        "# srun does not inherit --cpus-per-task from sbatch since SLURM 22.05",
        'if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"; fi',
        *setup,
        f'PYTHON="${{RL_PYTHON:-{sys.executable}}}"',
        "# one process per task (= per device); Lightning's SLURM environment wires up DDP and the requeue;",
        "# the first task to fail ends the step (the others would wait for it in a collective)",
        f'srun --kill-on-bad-exit=1 "$PYTHON" -m robust_lightning cell {shlex.quote(str(manifest))} '
        '--index "$SLURM_ARRAY_TASK_ID"',
        "",
    ]
    return "\n".join(lines)


def manifest_content(sweep: Sweep, cells: list[Cell]) -> dict[str, Any]:
    return {
        "sweep": sweep.name,
        "workdir": str(sweep.workdir),
        "log_pattern": str(sweep.output_dir / "logs" / "{job}_{task}.out"),
        "wandb": None if sweep.wandb is None else {"group": sweep.name, "tags": _wandb_tags(sweep)},
        "cells": [
            {"id": c.id, "labels": c.labels, "values": c.values, "dir": str(c.dir), "argv": c.argv} for c in cells
        ],
    }


def _wandb_tags(sweep: Sweep) -> list[str]:
    return [f"sweep:{sweep.name}", *[str(t) for t in (sweep.wandb or {}).get("tags", [])]]


def sweep_description(sweep: Sweep, cells: list[Cell]) -> dict[str, Any]:
    """sweep.json: every cell of the grid (what ``report`` expects to find), paths relative to the output dir."""
    return {
        "name": sweep.name,
        "command": sweep.command,
        "axes": [{"name": a.name, "labels": a.labels} for a in sweep.axes],
        "wandb": None
        if sweep.wandb is None
        else {
            "project": sweep.wandb.get("project", "robust-lightning"),
            "group": sweep.name,
            "tags": _wandb_tags(sweep),
        },
        "cells": [{"id": c.id, "labels": c.labels, "dir": str(c.dir.relative_to(sweep.output_dir))} for c in cells],
    }


def write_json(path: Path, content: Any) -> None:
    """Write JSON atomically (a reader never sees half a file), with sorted keys so reruns give the same bytes."""
    atomic_write_json(path, content, sort_keys=True, default=str)


def _next_array(output_dir: Path) -> int:
    taken = [int(p.stem) for p in (output_dir / "arrays").glob("*.json") if p.stem.isdigit()]
    return max(taken, default=-1) + 1


def _describe(cells: list[Cell], states: dict[str, str]) -> str:
    lines = []
    for i, cell in enumerate(cells):
        # the last three arguments point default_root_dir, checkpoints and loggers at the cell's directory
        command = "robust-lightning " + " ".join(shlex.quote(a) for a in cell.argv[:-3])
        lines.append(f"[{i}] {cell.id}\n    {command}\n    (+ run directory {cell.dir})")
    skipped = [f"    {cid}: {state}" for cid, state in states.items() if state != "to run"]
    if skipped:
        lines.append("skipped (done or still in the queue):\n" + "\n".join(skipped))
    return "\n".join(lines)


def check_cells(cells: list[Cell], check_command: Callable[[list[str]], None]) -> None:
    """Every cell's command line through ``check_command``, which parses it as the cell's task will and runs
    nothing (robust_lightning.cli.command_line_check): the first one it refuses stops the sweep, named."""
    for index, cell in enumerate(cells):
        try:
            check_command(cell.argv)
        except UserError as e:
            labels = ", ".join(f"{name}={label}" for name, label in cell.labels.items())
            raise UserError(f"sweep cell {index} ({labels or cell.id}): {e}") from None


def submit(sweep: Sweep, dry_run: bool, local: bool, check_command: Callable[[list[str]], None]) -> int:
    """Check every cell, then print (``dry_run``), run here (``local``) or submit as one SLURM array job the
    cells that are neither done nor still in the queue."""
    cells = expand(sweep)
    check_cells(cells, check_command)  # before anything is written or submitted: a bad cell would fail on the cluster
    queued = {} if local else queued_cells(sweep.output_dir)
    states = {}
    for cell in cells:
        state = cell_state(cell.dir)
        states[cell.id] = (
            "done" if state == "done" else f"in the queue ({queued[cell.id]})" if cell.id in queued else "to run"
        )
    todo = [c for c in cells if states[c.id] == "to run"]
    done = sum(s == "done" for s in states.values())
    summary = (
        f"sweep {sweep.name}: {len(cells)} cells, {done} done, {len(cells) - done - len(todo)} in the queue, "
        f"{len(todo)} to run"
    )
    number = _next_array(sweep.output_dir)
    manifest = sweep.output_dir / "arrays" / f"{number:03d}.json"
    script = array_script(sweep, todo, manifest) if todo else ""

    if dry_run:
        print(script if todo else "# nothing to submit")
        print(f"# {summary}\n" + "\n".join(f"# {line}" for line in _describe(todo, states).splitlines()))
        return 0
    write_json(sweep.output_dir / "sweep.json", sweep_description(sweep, cells))
    if not todo:
        print(f"{summary}: nothing to submit.\nreport: {user_command('report', str(sweep.output_dir))}")
        return 0
    write_json(manifest, manifest_content(sweep, todo))
    manifest.with_suffix(".sbatch").write_text(script)
    (sweep.output_dir / "logs").mkdir(parents=True, exist_ok=True)
    if local:
        return _run_local(sweep, todo, manifest, summary)
    if not shutil.which("sbatch"):
        raise UserError("sbatch not found: submit from a SLURM login node, or use --dry_run / --local")
    out = subprocess.run(
        ["sbatch", "--parsable", str(manifest.with_suffix(".sbatch"))],
        capture_output=True,
        text=True,
        cwd=sweep.workdir,
        timeout=120,
    )
    if out.returncode != 0:
        raise UserError(f"sbatch refused the array job: {out.stderr.strip() or out.stdout.strip()}")
    job_id = out.stdout.strip().split(";")[0]
    submissions = _submissions(sweep.output_dir) + [
        {"job_id": job_id, "manifest": str(manifest), "cells": [c.id for c in todo]}
    ]
    write_json(sweep.output_dir / "submissions.json", submissions)
    print(
        f"{summary}: submitted array job {job_id} ({manifest.with_suffix('.sbatch')})\n"
        f"logs: {sweep.output_dir / 'logs'}\nreport: {user_command('report', str(sweep.output_dir))}"
    )
    return 0


def sweep_main(argv: list[str], command_check: Callable[[], Callable[[list[str]], None]]) -> int:
    """``robust-lightning sweep``. ``command_check()`` makes the check of a cell's command line (the command line's
    parser, parsing only: robust_lightning.cli.command_line_check, handed in since scale/ never imports the
    command line)."""

    def sweep(
        name: str | None = None,
        command: str = "test",
        configs: list[str] | None = None,
        args: dict[str, Any] | None = None,
        grid: dict[str, Any] | None = None,
        output_dir: str | None = None,
        slurm: dict[str, Any] | None = None,
        wandb: bool | dict[str, Any] | None = None,
        dry_run: bool = False,
        local: bool = False,
    ) -> int:
        """Expand a sweep into cells and submit those without results as one SLURM array job.

        The sweep file is the tool's config file: robust-lightning sweep --config configs/sweeps/NAME.yaml,
        and any of its keys can be overridden on the command line.

        Args:
            name: the sweep's name (default: the sweep file's name)
            command: the robust-lightning command of every cell: fit, validate or test
            configs: config files of every cell, composed left to right
            args: fixed overrides of every cell, {config key: value}
            grid: the axes, {config key or bundle name: [values] or {label: value}}
            output_dir: where the cells, logs and report go (default: runs/sweeps/<name>)
            slurm: sbatch options, plus max_parallel (array throttle) and setup (shell lines)
            wandb: a WandbLogger for every cell, one group per sweep: true, or {project, tags, entity}
            dry_run: print the array script and the cells; submit nothing
            local: run the cells one after another here, without SLURM
        """
        spec = {
            "name": name,
            "command": command,
            "configs": configs,
            "args": args,
            "grid": grid,
            "output_dir": output_dir,
            "slurm": slurm,
            "wandb": wandb,
        }
        return submit(
            sweep_from_spec(spec, source=f"sweep {name}" if name else "sweep"), dry_run, local, command_check()
        )

    options, files = parse_tool_arguments(
        sweep,
        argv,
        prog="robust-lightning sweep",
        description="Expand a sweep file into cells and submit those without results as one SLURM array job, e.g.\n"
        "  robust-lightning sweep --config configs/sweeps/quickstart.yaml --dry_run",
    )
    if not options["name"] and files:
        options["name"] = files[-1].stem
    return sweep(**options)


def _run_local(sweep: Sweep, cells: list[Cell], manifest: Path, summary: str) -> int:
    print(summary, flush=True)
    failed = 0
    report = user_command("report", str(sweep.output_dir))
    for index, cell in enumerate(cells):
        log = sweep.output_dir / "logs" / f"local_{manifest.stem}_{index}.out"
        print(f"[{index + 1}/{len(cells)}] {cell.id} (log: {log})", flush=True)
        with open(log, "a") as f:
            command = [sys.executable, "-m", "robust_lightning", "cell", str(manifest), "--index", str(index)]
            cell_process = subprocess.Popen(
                command,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=sweep.workdir,
                env={**os.environ, "RL_SWEEP_LOG": str(log)},
            )
            code, stopped_by = wait_passing_on_sigterm(cell_process)
        failed += code != 0
        if stopped_by is not None:
            name = signal.Signals(stopped_by).name
            print(
                f"sweep stopped by {name} in cell {cell.id}, which ended with status {code}; "
                f"{len(cells) - index - 1} cells not started. The same sweep command runs the cells not done.\n"
                f"report: {report}",
                flush=True,
            )
            return 128 + stopped_by  # as a process ended by that signal
    print(f"{len(cells) - failed} of {len(cells)} cells succeeded\nreport: {report}")
    return 1 if failed else 0


def wait_passing_on_sigterm(process: subprocess.Popen[bytes]) -> tuple[int, int | None]:
    """Wait for a cell to end; returns its exit status and the signal that stopped the sweep meanwhile, if any.

    SIGTERM to the sweep (``kill``, or a scheduler's, which the cell gets too) is passed on to the cell, which
    stops at its next batch boundary and saves its state, as any command does. Ctrl-C reaches the cell from the
    terminal itself. Either way the sweep waits for the cell to end and then starts no other cell: Python's
    ``subprocess.run`` would kill the cell with SIGKILL a quarter of a second after Ctrl-C, in the middle of its
    save."""
    stopped_by: list[int] = []

    def note(signum: int, frame: object) -> None:
        stopped_by.append(signum)
        if signum == signal.SIGTERM and process.poll() is None:
            process.send_signal(signal.SIGTERM)

    previous = {signum: signal.signal(signum, note) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = process.wait()
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    return code, stopped_by[0] if stopped_by else None
