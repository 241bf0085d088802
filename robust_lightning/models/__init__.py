"""Models: timm backbones, ConvStem variants, input normalisation, warm start.

Importing this package registers the project's architectures with timm (``timm.create_model`` then knows
``convnext_tiny_convstem``, ``vit_small_patch16_224_convstem``, ``convnext_iso_small``, ...).
"""

from robust_lightning.models import (  # noqa: F401  (registers with timm)
    alternet,
    convstem,
    isotropic_convnext,
    large_kernel_convnext,
    replknet,
)
from robust_lightning.models.checkpoints import read_checkpoint, read_state_dict, save_net_weights
from robust_lightning.models.classifier import InputNormalization, RobustClassifier, build_classifier
from robust_lightning.models.convstem import CONVSTEM_PATCHSTEM_PAIRS, CONVSTEM_STEM_PREFIX, ConvStem
from robust_lightning.models.robustbench import robustbench_entries, robustbench_entry
from robust_lightning.models.weights import WarmStartReport, adopt_normalizer, load_model, load_pretrained

__all__ = [
    "CONVSTEM_PATCHSTEM_PAIRS",
    "CONVSTEM_STEM_PREFIX",
    "ConvStem",
    "InputNormalization",
    "RobustClassifier",
    "WarmStartReport",
    "adopt_normalizer",
    "build_classifier",
    "load_model",
    "load_pretrained",
    "read_checkpoint",
    "read_state_dict",
    "robustbench_entries",
    "robustbench_entry",
    "save_net_weights",
]
