"""What the fast engine's attacks run instead of the model (Croce & Hein's AutoAttack runs the model as given): a
copy with eval-mode BatchNorm folded into the convolution or linear layer before it (one op instead of two, forward
and backward), and on the CPU inputs in the channels_last layout, where oneDNN's convolutions and pooling run
faster (benchmarks/RESULTS.md). Logits and input gradients agree with the model's up to float rounding; the
ensemble verifies every success on the model as given (robust_lightning.attacks.ensemble)."""

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


class _ToChannelsLast(torch.autograd.Function):
    """A channels_last copy of the input whose gradient comes back in the standard layout, so the attacks'
    tensors keep their usual strides."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone(memory_format=torch.channels_last)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad.contiguous()


def attack_stand_in(
    model: Callable[[Tensor], Tensor], fold_batchnorm: bool, channels_last: bool
) -> tuple[Callable[[Tensor], Tensor], bool]:
    """What the fast engine's attacks run instead of ``model``: a copy with BatchNorm folded
    (:func:`folded_batchnorm`, where it applies) and/or fed channels_last inputs; and whether BatchNorm is
    folded in it."""
    folded = folded_batchnorm(model) if fold_batchnorm else None
    if folded is not None and channels_last:
        # the copy's weights in the inputs' layout: else oneDNN reorders them at every call (ResNet-18 at 32 px,
        # 24 rows: a forward pass 18 ms instead of 11 ms)
        folded = folded.to(memory_format=torch.channels_last)
    net = folded if folded is not None else model
    return (channels_last_inputs(net) if channels_last else net), folded is not None


def channels_last_inputs(model: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """``model`` called on channels_last copies of 4-d inputs; logits and input gradients are unchanged up to
    float rounding. On the CPU this runs oneDNN's NHWC kernels (max pooling in NCHW is many times slower)."""

    def forward(x: Tensor) -> Tensor:
        if x.dim() != 4:
            return model(x)
        try:
            return model(_ToChannelsLast.apply(x))
        except RuntimeError as error:
            if "view size is not compatible" not in str(error):
                raise
            raise RuntimeError(
                "the model cannot take channels_last inputs (it calls .view on an image or feature "
                "map); run AutoAttack with channels_last=False"
            ) from error

    return forward


def folded_batchnorm(model: Callable[[Tensor], Tensor]) -> nn.Module | None:
    """A copy of ``model`` (an ``nn.Module`` in eval mode) with each BatchNorm folded into the convolution or
    linear layer before it, so that the pair costs one op, forward and backward; logits agree up to float
    rounding. None where nothing folds, or where torch.fx cannot trace the model (with a warning)."""

    def batchnorms(module: nn.Module) -> int:
        return sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())

    if not isinstance(model, nn.Module) or model.training or not batchnorms(model):
        return None
    from torch.fx.experimental.optimization import fuse

    try:
        folded = fuse(model)  # works on a deep copy
    except Exception as error:  # noqa: BLE001 - tracing fails in many ways on dynamic code; the model still runs
        warnings.warn(f"BatchNorm not folded for the attacks: torch.fx cannot trace the model ({error})", stacklevel=2)
        return None
    if batchnorms(folded) == batchnorms(model):
        return None  # no BatchNorm follows a convolution or linear layer directly
    return folded.requires_grad_(False)


def folds_batchnorm(engine: str, requested: bool | None = None) -> bool:
    """Whether the attacks may run a BatchNorm-folded copy of the model: as ``requested`` (fast engine only),
    by default on (whether anything folds depends on the model: :func:`folded_batchnorm`)."""
    return engine == "fast" and requested is not False


def uses_channels_last(engine: str, device: torch.device, requested: bool | None = None) -> bool:
    """Whether the attacks feed the model channels_last inputs: as ``requested`` (fast engine only), by default
    on the CPU, where it measured faster (benchmarks/RESULTS.md), and not elsewhere, where it is unmeasured."""
    if engine == "reference" and requested:
        raise ValueError("channels_last applies to the fast engine only; the reference runs the model as is")
    return engine == "fast" and (device.type == "cpu" if requested is None else bool(requested))
