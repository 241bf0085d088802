"""A sweep file (``configs/sweeps/*.yaml``) read into a ``Sweep``, and expanded into its cells.

The file's format and the cells' run directories are described in ``robust_lightning.scale.sweep``, which
submits the cells. Each cell gets a stable id (the axis labels plus a hash of the values), the command line its
task runs, and loggers that write into its own directory.
"""

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from robust_lightning.argument_parsing import compose_config
from robust_lightning.errors import UserError

SBATCH_OWN = ("array", "output", "error")  # set by the sweep: one log per task under <output_dir>/logs
COMMANDS = ("fit", "validate", "test")
SPEC_KEYS = ("name", "command", "configs", "args", "grid", "output_dir", "slurm", "wandb")
BUNDLE_KEYS = {"configs", "args"}
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


def _logger_spec(sweep: Sweep, bundles: list[dict[str, Any]]) -> Any:
    """trainer.logger as the cell's configs and overrides leave it (the last one that sets it wins)."""
    logger: Any = None
    for config in sweep.configs + [c for b in bundles for c in b.get("configs", [])]:
        content = compose_config(Path(config)) or {}  # with the bases it extends
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
