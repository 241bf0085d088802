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
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from robust_lightning.argument_parsing import parse_tool_arguments
from robust_lightning.atomic import atomic_write_json
from robust_lightning.errors import UserError

COMMANDS = ("fit", "validate", "test")
SPEC_KEYS = ("name", "command", "configs", "args", "grid", "output_dir", "slurm", "wandb")
BUNDLE_KEYS = {"configs", "args"}
# every cell of an array gets the same resources; requeue + SIGUSR1@90 let Lightning save hpc_ckpt_N.ckpt in the
# cell's directory and requeue before the time limit (a resumed fit continues from it, AutoAttack from its outcomes)
SBATCH_DEFAULTS = {"nodes": 1, "ntasks-per-node": 1, "requeue": True, "signal": "SIGUSR1@90", "open-mode": "append"}
SBATCH_OWN = ("array", "output", "error")  # set by the sweep: one log per task under <output_dir>/logs
SLURM_EXTRA = ("max_parallel", "setup")
CSV_LIKE = ("CSVLogger", "TensorBoardLogger")
DEFAULT_LOGGER = "lightning.pytorch.loggers.CSVLogger"
WANDB_LOGGER = "lightning.pytorch.loggers.WandbLogger"
KEY_PATTERN = re.compile(r"^[A-Za-z_]\w*(\.\w+)*$")


@dataclass
class Axis:
    name: str  # a config key (data.image_size) or, for bundles, a name of the sweep's choosing (benchmark)
    labels: list[str]
    values: list[Any]  # config values, or bundles {configs: [...], args: {...}}
    bundle: bool = False

    @property
    def short(self) -> str:
        return self.name.rsplit(".", 1)[-1]


@dataclass
class Cell:
    id: str
    labels: dict[str, str]  # axis name -> label
    values: dict[str, Any]  # axis name -> value (or bundle)
    argv: list[str]  # robust-lightning arguments, the command first
    dir: Path


@dataclass
class Sweep:
    name: str
    command: str
    configs: list[str]
    args: dict[str, Any]
    axes: list[Axis]
    output_dir: Path
    slurm: dict[str, Any] = field(default_factory=dict)
    wandb: dict[str, Any] | None = None
    workdir: Path = field(default_factory=Path.cwd)


# ------------------------------------------------------------------------------------------- the sweep file
def _label(value: Any) -> str:
    text = f"{value:g}" if isinstance(value, float) else value if isinstance(value, str) else json.dumps(value)
    text = re.sub(r"[^A-Za-z0-9._+-]+", "_", str(text)).strip("_.")
    return text[-40:] or "x"  # the tail of a long path is the telling part; the id's hash keeps cells apart


def _axis(name: Any, spec: Any) -> Axis:
    if not isinstance(name, str) or not KEY_PATTERN.match(name):
        raise UserError(f"grid axis {name!r}: expected a config key like data.image_size or a name like benchmark")
    if isinstance(spec, dict) and spec:
        labels, values = [_label(k) for k in spec], list(spec.values())
        bundle = all(isinstance(v, dict) and v and set(v) <= BUNDLE_KEYS for v in values)
        if bundle:
            for label, value in zip(labels, values):
                if not isinstance(value.get("configs", []), list) or not isinstance(value.get("args", {}), dict):
                    raise UserError(
                        f"grid axis {name!r}, {label!r}: a bundle is {{configs: [files], args: {{key: value}}}}"
                    )
        elif any(isinstance(v, dict) and set(v) & BUNDLE_KEYS for v in values):
            raise UserError(f"grid axis {name!r}: every value must be a bundle {{configs, args}} or none")
    elif isinstance(spec, list) and spec:
        labels, values, bundle = [_label(v) for v in spec], list(spec), False
    else:
        raise UserError(
            f"grid axis {name!r}: expected a non-empty list of values or a mapping label -> value, got {spec!r}"
        )
    if len(set(labels)) != len(labels):
        raise UserError(
            f"grid axis {name!r}: two values have the same label ({', '.join(labels)}); name them with "
            "a mapping label -> value"
        )
    return Axis(name, labels, values, bundle)


def load_sweep(path: str | Path, wandb: bool = False, output_dir: str | None = None) -> Sweep:
    """The sweep of a sweep file; ``wandb`` adds W&B logging when the file has none, ``output_dir`` overrides."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"sweep file {path} not found")
    spec = yaml.safe_load(path.read_text()) or {}
    if not isinstance(spec, dict):
        raise UserError(f"{path}: expected a mapping with keys {', '.join(SPEC_KEYS)}")
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise UserError(f"{path}: unknown key(s) {', '.join(unknown)}; expected {', '.join(SPEC_KEYS)}")
    if wandb and not spec.get("wandb"):
        spec["wandb"] = True
    if output_dir:
        spec["output_dir"] = output_dir
    spec.setdefault("name", None)
    spec["name"] = spec["name"] or path.stem
    return sweep_from_spec(spec, source=str(path))


def sweep_from_spec(spec: dict[str, Any], source: str) -> Sweep:
    """Check a sweep's description (the keys of a sweep file) and build the Sweep; ``source`` names where the
    description came from in the error messages."""
    name = str(spec.get("name") or "")
    if not name:
        raise UserError(f"{source}: the sweep has no name (give a sweep file with --config FILE, or --name)")
    if not re.fullmatch(r"[A-Za-z0-9._-]+", name):
        raise UserError(f"{source}: name {name!r} may hold only letters, digits, '.', '_' and '-'")
    command = spec.get("command", "test")
    if command not in COMMANDS:
        raise UserError(f"{source}: command must be one of {', '.join(COMMANDS)}, got {command!r}")
    configs = spec.get("configs") or []
    args = spec.get("args") or {}
    grid = spec.get("grid") or {}
    slurm = spec.get("slurm") or {}
    if (
        not isinstance(configs, list)
        or not isinstance(args, dict)
        or not isinstance(grid, dict)
        or not isinstance(slurm, dict)
    ):
        raise UserError(f"{source}: configs is a list of files; args, grid and slurm are mappings")
    for key in args:
        if not KEY_PATTERN.match(str(key)):
            raise UserError(f"{source}: args key {key!r} is not a config key like data.image_size")
    own = sorted(k for k in slurm if str(k).replace("_", "-") in SBATCH_OWN)
    if own:
        raise UserError(f"{source}: slurm.{own[0]} is set by the sweep itself (one array task and log per cell)")
    wandb_spec = spec.get("wandb")
    if wandb_spec is True:
        wandb_spec = {}
    elif wandb_spec in (None, False):
        wandb_spec = None
    elif not isinstance(wandb_spec, dict):
        raise UserError(f"{source}: wandb is true or a mapping (project, tags, entity)")
    sweep = Sweep(
        name=name,
        command=command,
        configs=[str(c) for c in configs],
        args=args,
        axes=[_axis(k, v) for k, v in grid.items()],
        output_dir=Path(spec.get("output_dir") or f"runs/sweeps/{name}").absolute(),
        slurm=slurm,
        wandb=wandb_spec,
    )
    for config in sweep.configs + [c for a in sweep.axes if a.bundle for v in a.values for c in v.get("configs", [])]:
        if not Path(config).is_file():
            raise UserError(f"{source}: config file {config} not found (paths are relative to {Path.cwd()})")
    return sweep


# ------------------------------------------------------------------------------------------------ cells
def _cli_value(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _logger_spec(sweep: Sweep, bundles: list[dict]) -> Any:
    """trainer.logger as the cell's configs and overrides leave it (the last one that sets it wins)."""
    logger: Any = None
    for config in sweep.configs + [c for b in bundles for c in b.get("configs", [])]:
        content = yaml.safe_load(Path(config).read_text()) or {}
        trainer = content.get("trainer") if isinstance(content, dict) else None
        if isinstance(trainer, dict) and "logger" in trainer:
            logger = trainer["logger"]
    for args in [sweep.args] + [b.get("args", {}) for b in bundles]:
        if "trainer.logger" in args:
            logger = args["trainer.logger"]
    return logger


def cell_loggers(logger: Any, cell_dir: Path, cell_id: str, sweep: Sweep) -> Any:
    """The cell's loggers: those of its configs, all writing into the cell's directory (CSV/TensorBoard without
    name/version subfolders, so results.json lands in it), plus a WandbLogger when the sweep asks for W&B."""
    if logger is False and sweep.wandb is None:
        return False
    entries = [] if logger in (None, True, False) else logger if isinstance(logger, list) else [logger]
    loggers = []
    for entry in entries:
        entry = {"class_path": entry} if isinstance(entry, str) else dict(entry)
        init = dict(entry.get("init_args") or {})
        init["save_dir"] = str(cell_dir)
        kind = str(entry.get("class_path", "")).rsplit(".", 1)[-1]
        if kind in CSV_LIKE:
            init.update(name="", version="")
        if kind == "WandbLogger":
            init["name"] = cell_id
        entry["init_args"] = init
        loggers.append(entry)
    if not any(str(e.get("class_path", "")).rsplit(".", 1)[-1] in CSV_LIKE for e in loggers):
        loggers.insert(
            0, {"class_path": DEFAULT_LOGGER, "init_args": {"save_dir": str(cell_dir), "name": "", "version": ""}}
        )
    if sweep.wandb is not None and not any(str(e.get("class_path", "")).endswith("WandbLogger") for e in loggers):
        init = {
            "save_dir": str(cell_dir),
            "name": cell_id,
            "log_model": False,
            "project": sweep.wandb.get("project", "robust-lightning"),
        }
        if sweep.wandb.get("entity"):
            init["entity"] = sweep.wandb["entity"]
        loggers.append({"class_path": WANDB_LOGGER, "init_args": init})
    return loggers


def expand(sweep: Sweep) -> list[Cell]:
    """All cells of the grid, in order (the last axis varies fastest)."""
    combos: list[list[int]] = [[]]
    for axis in sweep.axes:
        combos = [c + [i] for c in combos for i in range(len(axis.values))]
    cells = []
    for combo in combos:
        labels = {a.name: a.labels[i] for a, i in zip(sweep.axes, combo)}
        values = {a.name: a.values[i] for a, i in zip(sweep.axes, combo)}
        shorts = [a.short for a in sweep.axes]
        slug = "__".join(f"{a.short if shorts.count(a.short) == 1 else a.name}={labels[a.name]}" for a in sweep.axes)
        digest = hashlib.sha1(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:8]
        cell_id = f"{slug[:120]}__{digest}" if slug else digest
        cell_dir = sweep.output_dir / "cells" / cell_id
        bundles = [values[a.name] for a in sweep.axes if a.bundle]
        argv = [sweep.command]
        for config in sweep.configs + [c for b in bundles for c in b.get("configs", [])]:
            argv += ["--config", config]
        overrides = dict(sweep.args)
        for bundle in bundles:
            overrides.update(bundle.get("args", {}))
        overrides.update({a.name: values[a.name] for a in sweep.axes if not a.bundle})
        overrides.pop("trainer.logger", None)  # replaced below by the same loggers, pointed at the cell
        argv += [f"--{key}={_cli_value(value)}" for key, value in overrides.items()]
        # the cell's own directory for everything it writes: no mixing, and no other run's hpc_ckpt_* to pick up
        argv += [
            f"--trainer.default_root_dir={cell_dir}",
            f"--checkpoint.dirpath={cell_dir / 'checkpoints'}",
            f"--trainer.logger={_cli_value(cell_loggers(_logger_spec(sweep, bundles), cell_dir, cell_id, sweep))}",
        ]
        cells.append(Cell(cell_id, labels, values, argv, cell_dir))
    return cells


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
    return cell_status(cell_dir).get("status", "missing")


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
        "# one process per task (= per device); Lightning's SLURM environment wires up DDP and the requeue",
        f'srun "$PYTHON" -m robust_lightning cell {shlex.quote(str(manifest))} --index "$SLURM_ARRAY_TASK_ID"',
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
        print(f"{summary}: nothing to submit.\nreport: robust-lightning report {sweep.output_dir}")
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
        f"logs: {sweep.output_dir / 'logs'}\nreport: robust-lightning report {sweep.output_dir}"
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
    for index, cell in enumerate(cells):
        log = sweep.output_dir / "logs" / f"local_{manifest.stem}_{index}.out"
        print(f"[{index + 1}/{len(cells)}] {cell.id} (log: {log})", flush=True)
        with open(log, "a") as f:
            command = [sys.executable, "-m", "robust_lightning", "cell", str(manifest), "--index", str(index)]
            code = subprocess.run(
                command,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=sweep.workdir,
                env={**os.environ, "RL_SWEEP_LOG": str(log)},
            ).returncode
        failed += code != 0
    print(f"{len(cells) - failed} of {len(cells)} cells succeeded\nreport: robust-lightning report {sweep.output_dir}")
    return 1 if failed else 0
