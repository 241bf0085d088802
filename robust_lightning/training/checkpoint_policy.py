"""Which settings win when a command is given a checkpoint (``--ckpt_path``) and model settings of its own.

LightningCLI re-parses the checkpoint's hyper-parameters over the command line and the configs. The settings
that define the checkpoint's tensors (the architecture, the normaliser) and, for ``fit``, the optimiser whose
state it resumes, are the checkpoint's: a different value given is an error. Other model settings given apply
over the checkpoint's (``model_settings_over_checkpoint``).
"""

import inspect
import math
from typing import Any

from robust_lightning.errors import UserError
from robust_lightning.models.checkpoints import read_lightning_checkpoint
from robust_lightning.training.lightning_module import ImageClassifier

# The user's documentation: docs/command-line.md, "What a checkpoint carries". Given settings apply, except:
ARCHITECTURE_SETTINGS = ("arch", "arch_kwargs", "mean", "std", "small_input", "ema_decay")  # define its tensors
OPTIMIZER_SETTINGS = ("lr", "min_lr", "warmup_epochs", "weight_decay", "weight_decay_rule", "betas")  # fit resumes them
# unused: the checkpoint's weights replace a warm start
WARM_START_SETTINGS = ("init_from", "init_from_ema", "new_head")
DATA_LINKED_SETTINGS = ("num_classes", "image_size")  # set from data.*; on_load_checkpoint refuses a mismatch


def _same(a: Any, b: Any) -> bool:
    """Equal as settings: lists and tuples alike, floats to float32 precision (a normaliser read from tensors)."""
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if type(a) in (int, float) and type(b) in (int, float):
        return math.isclose(a, b, rel_tol=1e-6)
    return bool(a == b)


def model_settings_over_checkpoint(
    subcommand: str, ckpt_path: str, model: dict[str, Any], named: set[str]
) -> dict[str, Any]:
    """The model settings given on the command line or in a config that differ from the checkpoint's and apply
    over them; a UserError for one the checkpoint decides. A setting counts as given when it is named on the
    command line or differs from ImageClassifier's default."""
    saved = read_lightning_checkpoint(ckpt_path)
    defaults = {name: p.default for name, p in inspect.signature(ImageClassifier.__init__).parameters.items()}
    applied = {}
    for key, value in model.items():
        if key not in saved or key in WARM_START_SETTINGS or key in DATA_LINKED_SETTINGS:
            continue
        given = key in named or not _same(value, defaults.get(key, value))
        if not given or _same(value, saved[key]):
            continue
        if key in ARCHITECTURE_SETTINGS:
            wins = "the architecture and the input normaliser, which define the weights it holds"
        elif key in OPTIMIZER_SETTINGS and subcommand == "fit":
            wins = "the optimiser and the learning-rate schedule, whose state fit resumes from it"
        else:
            applied[key] = value
            continue
        option = f"--model.{key}" if key in named else f"model.{key} (from a config)"
        raise UserError(
            f"{option} {value!r} conflicts with the checkpoint's {key} {saved[key]!r} ({ckpt_path}): "
            f"the checkpoint's setting wins for {wins}; drop the option"
        )
    return applied
