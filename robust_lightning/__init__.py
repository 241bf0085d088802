"""robust-lightning: adversarial training and robustness evaluation of vision models."""

__version__ = "0.1.0"

# Registering the project's model variants with timm is a side effect of importing the models package.
from robust_lightning import models  # noqa: E402,F401
from robust_lightning.models.weights import load_model  # noqa: E402

__all__ = ["load_model"]
