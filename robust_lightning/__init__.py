"""robust-lightning: adversarial training and robustness evaluation of vision models."""

__version__ = "0.1.0"

from typing import TYPE_CHECKING

from robust_lightning.startup import collector_paused

with collector_paused():  # torch and timm import sooner (robust_lightning/startup.py)
    # First, before timm imports wandb: its temporary folders into one a killed process's successor removes.
    from robust_lightning.wandb_temp_folders import import_wandb_into_process_folder

    import_wandb_into_process_folder()

    # Registering the project's model variants with timm is a side effect of importing the models package.
    from robust_lightning import models  # noqa: F401
    from robust_lightning.models.weights import load_model

__all__ = ["benchmark", "evaluate", "load_model"]

if TYPE_CHECKING:  # their types; at run time __getattr__ imports them on first use
    from robust_lightning.any_model import benchmark, evaluate


def __getattr__(name: str) -> object:
    # evaluate and benchmark bring in Lightning and every evaluation: imported on first use, not with the package
    if name in ("evaluate", "benchmark"):
        from robust_lightning import any_model

        return getattr(any_model, name)
    raise AttributeError(f"module 'robust_lightning' has no attribute {name!r}")
