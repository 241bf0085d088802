"""What an evaluation or analysis may ask of the LightningModule it evaluates (``EvaluatedModule``), and all it may
ask; ImageClassifier provides it. The module's other attributes are its own: an evaluation reads them through
these, never directly. The data side of the same contract is ``robust_lightning.data.contract.EvaluationData``.
"""

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any, Protocol

import torch
from torch import nn

from robust_lightning.models.classifier import RobustClassifier


class EvaluatedModule(Protocol):
    """The evaluated module:

    - ``model``: the network, [0, 1] images in, logits out;
    - ``ema``: its exponential moving average (``ema.module`` the averaged network), None without one;
    - ``hparams``: its settings, read through ``model_setting`` (arch, num_classes, image_size, weight_decay);
    - ``run_network(network, images)``: a forward pass through the module's own runner, which applies its memory
      format (channels_last) and precision;
    - ``conditions()``: what results.json records about the model.
    """

    model: RobustClassifier
    ema: Any
    hparams: Mapping[str, Any]

    def run_network(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor: ...

    def conditions(self) -> dict[str, Any]: ...


def model_setting(pl_module: object, key: str, default: Any = None) -> Any:
    """A setting of the evaluated module (``hparams[key]``), ``default`` where it has none: a module of another
    kind, or one that a test builds with only the settings it needs."""
    hparams = getattr(pl_module, "hparams", None) or {}
    return hparams.get(key, default)


def network_runner(pl_module: object, network: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """``network`` as the module runs it (``run_network``), or the bare network for a module without a runner."""
    run = getattr(pl_module, "run_network", None)
    return partial(run, network) if run is not None else network


def model_conditions(pl_module: object) -> dict[str, Any] | str:
    """What results.json records about the model: its ``conditions()``, or its type for a module without them."""
    conditions = getattr(pl_module, "conditions", None)
    return conditions() if conditions is not None else type(pl_module).__name__
