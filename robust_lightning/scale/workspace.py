"""``robust-lightning workspace``: the W&B workspace a robustness researcher reads, saved to a project in one command.

Sections, in order: adversarial training (clean and adversarial loss and accuracy, lr, eps), validation (clean
and robust accuracy of the raw and the EMA weights, the selection score), throughput (images/s per device, step
time, data-wait share) and the evaluations' tables (AutoAttack, the robustness card, ImageNet-C, the
distribution shifts, the resolution sweep). The panels name the keys the runs log (ImageClassifier,
training.throughput, the evaluation callbacks). Built with the wandb-workspaces package; ``--dry_run`` prints
it and needs no network.
"""

import json
import os
import sys
from typing import TYPE_CHECKING

from robust_lightning.argument_parsing import run_tool
from robust_lightning.errors import UserError

if TYPE_CHECKING:
    from wandb_workspaces.workspaces import Workspace

# (section, [(panel title, [keys])]) for line plots; the tables are logged as W&B tables
CURVES = [
    (
        "Adversarial training",
        [
            ("loss", ["train/clean_loss", "train/adv_loss"]),
            ("accuracy on the training batches", ["train/clean_acc1", "train/adv_acc1"]),
            ("learning rate", ["train/lr"]),
            ("attack radius", ["train/eps"]),
        ],
    ),
    (
        "Validation",
        [
            ("clean accuracy", ["val/acc1", "val_ema/acc1"]),
            ("robust accuracy (selection attack)", ["val/robust_acc", "val_ema/robust_acc"]),
            ("checkpoint score", ["val/select_acc"]),
            ("loss", ["val/loss", "val_ema/loss"]),
        ],
    ),
    (
        "Throughput",
        [
            ("images/s per device", ["perf/images_per_s"]),
            ("seconds per optimiser step", ["perf/step_seconds"]),
            ("share of the step waiting for data", ["perf/data_wait_share"]),
        ],
    ),
]
TABLES = (
    "autoattack/summary",
    "card/summary",
    "imagenet_c/per_corruption",
    "benchmarks/summary",
    "resolution_sweep/summary",
)


def build_workspace(entity: str, project: str, name: str) -> "Workspace":
    """The workspace as a wandb_workspaces object (nothing is sent). wandb-workspaces is the optional extra
    ``workspace``: imported here, so that the rest of the package runs without it."""
    try:
        import wandb_workspaces.reports.v2 as wr
        import wandb_workspaces.workspaces as ws
    except ImportError:
        raise UserError(
            "robust-lightning workspace needs wandb-workspaces: pip install 'robust-lightning[workspace]'"
        ) from None

    sections = [
        ws.Section(
            name=section, is_open=True, panels=[wr.LinePlot(title=title, y=list(keys)) for title, keys in panels]
        )
        for section, panels in CURVES
    ]
    sections.append(
        ws.Section(
            name="Evaluation tables",
            is_open=True,
            panels=[wr.WeavePanelSummaryTable(table_name=table) for table in TABLES],
        )
    )
    return ws.Workspace(entity=entity, project=project, name=name, sections=sections)


def describe(workspace: "Workspace") -> dict[str, list[object]]:
    """Sections and what their panels show, as a plain mapping (what --dry_run prints)."""
    return {
        section.name: [getattr(panel, "y", None) or getattr(panel, "table_name", None) for panel in section.panels]
        for section in workspace.sections
    }


def workspace(
    project: str = "robust-lightning", entity: str | None = None, name: str = "robust-lightning", dry_run: bool = False
) -> int:
    """Save the project's W&B workspace (W&B online: an API key or `wandb login`).

    Args:
        project: the W&B project the runs log to (configs/loggers/wandb.yaml: robust-lightning).
        entity: the W&B user or team; default: the logged-in account's default entity.
        name: the workspace's name in the project.
        dry_run: print the workspace's sections and panels instead of saving it (no network).
    """
    if dry_run:
        print(json.dumps(describe(build_workspace(entity or "ENTITY", project, name)), indent=2))
        return 0
    if os.environ.get("WANDB_MODE") in ("offline", "disabled"):
        raise UserError(
            f"WANDB_MODE is {os.environ['WANDB_MODE']}: saving a workspace needs W&B online "
            "(unset it, and wandb login); --dry_run prints the workspace without W&B"
        )
    import wandb

    try:
        entity = entity or wandb.Api().default_entity
        # None (no default entity) goes on to wandb_workspaces, which refuses it, as before; Workspace.save has
        # no annotations
        saved = build_workspace(entity, project, name).save()  # type: ignore[arg-type, no-untyped-call]
    except UserError:  # wandb-workspaces missing: its own message
        raise
    except Exception as e:  # no credentials, no network, an unknown project: the library's own message
        raise UserError(
            f"could not save the workspace to W&B ({type(e).__name__}: {e}); check `wandb login` "
            "and the network, or use --dry_run"
        ) from None
    print(f"workspace saved: {saved.url}")
    return 0


def workspace_main(argv: list[str] | None = None) -> int:
    return run_tool(
        workspace,
        sys.argv[1:] if argv is None else argv,
        prog="robust-lightning workspace",
        description="Save the W&B workspace of a project: training curves, validation (raw and EMA), "
        "throughput and the evaluation tables, e.g.\n  robust-lightning workspace --project "
        "robust-lightning --dry_run",
    )
