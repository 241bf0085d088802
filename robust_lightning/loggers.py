"""The complete run config in W&B, and summaries that keep the best validation scores.

LightningCLI writes config.yaml into the run directory, but a WandbLogger only receives the hyperparameters of the
model and the data module. ``SaveConfigToWandb`` also puts the whole parsed config (trainer, model, data, callbacks,
checkpoint, ckpt_path, seed) into the config of every W&B run, flattened to the command line's own key
names (``trainer.max_epochs``, ``model.attack_steps``, ``data.image_size``), so a W&B dashboard can filter and group
runs by any option, and stores the exact YAML with the run's files (``lightning_config.yaml``).
"""

from pathlib import Path
from typing import Any

import yaml
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_warn

# not config.yaml: W&B keeps its own run config under that name in the same folder
WANDB_CONFIG_FILE = "lightning_config.yaml"
# validation scores whose W&B summary is their best value over the run (W&B's default is the last)
BEST_IS_MAX = ("val/select_acc", "val/robust_acc", "val_ema/robust_acc", "val/acc1", "val_ema/acc1")


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings to one level with dotted keys (lists, e.g. of callbacks, stay values)."""
    flat = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class SaveConfigToWandb(SaveConfigCallback):
    """LightningCLI's SaveConfigCallback (config.yaml in ``trainer.log_dir``), plus the full config in each W&B run."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        first = trainer.loggers[0] if trainer.loggers else None
        if first is not None and not isinstance(first, (CSVLogger, TensorBoardLogger)) and not self.already_saved:
            # trainer.log_dir is then the first logger's bare save_dir, shared by every run: config.yaml and
            # results.json of one run would overwrite (or merge into) another's. The W&B copy stays per run.
            rank_zero_warn(
                f"the first logger ({type(first).__name__}) has no per-run directory: config.yaml and "
                f"results.json go to {first.save_dir} for every run. List a CSVLogger first "
                "(configs/loggers/wandb.yaml does)."
            )
        super().setup(trainer, pl_module, stage)

    def save_config(self, trainer, pl_module, stage: str) -> None:  # rank zero only
        wandb_loggers = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]
        if not wandb_loggers:
            return
        text = self.parser.dump(self.config, skip_none=False)  # what config.yaml holds
        config = flatten(yaml.safe_load(text))
        for logger in wandb_loggers:
            logger.log_hyperparams(config)
            run = logger.experiment
            for name in BEST_IS_MAX:  # the run's summary keeps the best value, not the last
                run.define_metric(name, step_metric="trainer/global_step", step_sync=True, summary="max")
            if Path(run.dir).is_dir():  # not with WANDB_MODE=disabled: no files then
                path = Path(run.dir) / WANDB_CONFIG_FILE
                path.write_text(text)
                run.save(str(path), base_path=run.dir, policy="now")
