"""``robust-lightning report DIR``: the results of every cell of a sweep in one table.

Reads the cells that ``sweep.json`` of DIR lists (or, without it, every ``cells/*/results.json``), flattens the
scalar metrics of each done cell's results.json into one row keyed by its grid labels, and writes
``report.md``, ``report.csv`` and ``report.json`` into DIR (and a W&B table with ``--wandb true`` or when the
sweep logs to W&B, unless ``--wandb false``). One row per cell, whatever was appended to its results over
retries; cells that are missing, failed or still running are listed with their reason and the tail of their
SLURM log. Nothing depends on the time or on the order of the file system: running it twice gives the same
bytes.
"""

import csv
import fnmatch
import io
import json
import sys
from pathlib import Path
from typing import Any

from robust_lightning.argument_parsing import run_tool
from robust_lightning.atomic import atomic_write_text
from robust_lightning.errors import UserError
from robust_lightning.scale.sweep import cell_status, write_json

RUN_SECTIONS = ("fit", "validate", "test")
# conditions and bookkeeping, not measurements (eps is in the threat model's name already)
SKIPPED = {
    "conditions",
    "seconds_this_session",
    "claims_refuted_in_fp32_this_session",
    "checkpoint",
    "best_checkpoint",
    "last_checkpoint",
    "corrupt_images",
    "eps",
}
DROPPED = {"metrics", "threat_models"}  # containers whose name adds nothing to a column name
LOG_LINES = 20
REASONS = {
    "missing": "no result (never ran, or still in the queue)",
    "running": "started, no result yet (still running, or killed without a word)",
    "failed": "failed (see the log)",
    "interrupted": "interrupted (time limit, requeue or scancel); the next sweep resumes it",
}


def _walk(node: Any, path: list[str], out: dict[str, float]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key not in SKIPPED:
                _walk(value, path if key in DROPPED else [*path, str(key)], out)
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        out.setdefault(".".join(path), node)


def flatten(results: dict[str, Any]) -> dict[str, float]:
    """Scalar metrics of a results.json: run metrics by their logged names (test/acc1), other sections by
    their path (autoattack.Linf-4_255.robust_accuracy); conditions and bookkeeping are left out."""
    row: dict[str, float] = {}
    for section, content in results.items():
        if section == "sweep" or not isinstance(content, dict):
            continue
        if section in RUN_SECTIONS:
            for name, value in (content.get("metrics") or {}).items():
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    row[name if name not in row else f"{section}:{name}"] = value
            _walk({k: v for k, v in content.items() if k != "metrics"}, [section], row)
        else:
            _walk(content, [section], row)
    return row


def _expected_cells(directory: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(sweep description, cells) from sweep.json; without it, the cells found on disk."""
    description_path = directory / "sweep.json"
    if description_path.is_file():
        description = json.loads(description_path.read_text())
        return description, description["cells"]
    cells = []
    for path in sorted((directory / "cells").glob("*/results.json")):
        status = cell_status(path.parent)
        cells.append(
            {
                "id": status.get("cell", path.parent.name),
                "labels": status.get("labels", {}),
                "dir": str(path.parent.relative_to(directory)),
            }
        )
    if not cells:
        raise UserError(
            f"{directory} holds no sweep: no sweep.json and no cells/*/results.json (run robust-lightning sweep first)"
        )
    axes = sorted({a for c in cells for a in c["labels"]})
    return {"name": directory.name, "axes": [{"name": a} for a in axes], "wandb": None}, cells


def _log_tail(directory: Path, cell_id: str, status: dict[str, Any]) -> tuple[str | None, str]:
    """The SLURM log of the cell's last attempt (from its status, else from the submissions) and its tail."""
    log = status.get("log")
    if not log:
        submissions = directory / "submissions.json"
        for submission in reversed(json.loads(submissions.read_text()) if submissions.is_file() else []):
            if cell_id in submission["cells"]:
                log = str(directory / "logs" / f"{submission['job_id']}_{submission['cells'].index(cell_id)}.out")
                break
    if not log or not Path(log).is_file():
        return None, ""
    lines = Path(log).read_text(errors="replace").splitlines()
    return log, "\n".join(lines[-LOG_LINES:])


def _format(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def build_report(directory: Path, columns: list[str] | None = None) -> dict[str, Any]:
    description, cells = _expected_cells(directory)
    axes = [a["name"] for a in description["axes"]]
    metric_names: set[str]
    rows, problems, metric_names = [], [], set()
    for cell in cells:  # one entry per expected cell: nothing counted twice, nothing silently missing
        cell_dir = directory / cell["dir"]
        status = cell_status(cell_dir)
        state = status.get("status", "missing")
        metrics: dict[str, float] = {}
        if state == "done":
            metrics = flatten(json.loads((cell_dir / "results.json").read_text()))
            if columns:
                metrics = {k: v for k, v in metrics.items() if any(fnmatch.fnmatchcase(k, p) for p in columns)}
            metric_names.update(metrics)
        else:
            log, tail = _log_tail(directory, cell["id"], status)
            reason = status.get("error") or REASONS.get(state, state)
            problems.append(
                {
                    "cell": cell["id"],
                    "labels": cell["labels"],
                    "state": state,
                    "reason": reason,
                    "log": log,
                    "log_tail": tail,
                }
            )
        rows.append({**{a: cell["labels"].get(a) for a in axes}, "cell": cell["id"], "status": state, **metrics})
    header = [*axes, "cell", "status", *sorted(metric_names)]
    return {
        "sweep": description.get("name"),
        "columns": header,
        "rows": rows,
        "missing_or_failed": problems,
        "cells": len(cells),
        "done": len(cells) - len(problems),
        "wandb": description.get("wandb"),
    }


def render_markdown(report: dict[str, Any]) -> str:
    header = report["columns"]
    lines = [
        f"# Sweep {report['sweep']}",
        "",
        f"{report['done']} of {report['cells']} cells done.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for row in report["rows"]:
        lines.append("| " + " | ".join(_format(row.get(c)) for c in header) + " |")
    if report["missing_or_failed"]:
        lines += ["", "## Missing or failed cells", ""]
        for problem in report["missing_or_failed"]:
            lines.append(
                f"- `{problem['cell']}`: {problem['state']}: {problem['reason']}"
                + (f" (log: {problem['log']})" if problem["log"] else "")
            )
            if problem["log_tail"]:
                lines += ["", "  ```", *[f"  {line}" for line in problem["log_tail"].splitlines()], "  ```"]
    return "\n".join(lines) + "\n"


def render_csv(report: dict[str, Any]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(report["columns"])
    for row in report["rows"]:
        writer.writerow(["" if row.get(c) is None else row[c] for c in report["columns"]])
    return buffer.getvalue()


def _write_text(path: Path, text: str) -> None:
    atomic_write_text(path, text)


def log_wandb_table(report: dict[str, Any], directory: Path) -> None:
    import wandb

    settings = report.get("wandb") or {}
    run = wandb.init(
        project=settings.get("project", "robust-lightning"),
        group=settings.get("group", report["sweep"]),
        tags=settings.get("tags"),
        job_type="report",
        name=f"{report['sweep']}-report",
        dir=str(directory),
    )
    table = wandb.Table(
        columns=report["columns"], data=[[row.get(c) for c in report["columns"]] for row in report["rows"]]
    )
    run.log({"sweep/report": table})
    run.finish()


def report(directory: str, columns: list[str] | None = None, wandb: bool | None = None) -> int:
    """Merge the results.json of every cell of a sweep into report.md, report.csv and report.json.

    Args:
        directory: the sweep's output_dir (holding sweep.json and cells/)
        columns: keep only the metrics matching these patterns, e.g. ['test/*', 'autoattack.*']
        wandb: also log the table to W&B (true), never (false), or when the sweep does (null)
    """
    path = Path(directory)
    if not path.is_dir():
        raise UserError(f"{path} is not a directory")
    table = build_report(path, columns)
    markdown = render_markdown(table)
    _write_text(path / "report.md", markdown)
    _write_text(path / "report.csv", render_csv(table))
    write_json(path / "report.json", table)
    if wandb or (wandb is None and table["wandb"]):
        log_wandb_table(table, path)
    print(markdown)
    print(f"written: {path / 'report.md'}, report.csv, report.json")
    return 0


def report_main(argv: list[str] | None = None) -> int:
    return run_tool(
        report,
        sys.argv[1:] if argv is None else argv,
        prog="robust-lightning report",
        description="Merge the results.json of every cell of a sweep into report.md, report.csv and "
        "report.json, e.g.\n  robust-lightning report runs/sweeps/quickstart --columns 'test/*' "
        "'autoattack.*'",
    )
