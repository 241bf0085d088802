"""The model the project trains and attacks: images in [0, 1] -> (optional) normalisation -> timm net -> logits.

Attacks perturb and clip in [0, 1] pixel space, so the normaliser must sit inside the model. Keeping it as a
module with persistent buffers also records the input convention in every checkpoint (``normalize.mean`` /
``normalize.std``), which is what prevents normalising twice (the released models of Singh et al. take raw
[0, 1] input; one of them wraps a normaliser).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

import timm
import torch
from torch import nn

from robust_lightning.errors import UserError

__all__ = ["InputNormalization", "RobustClassifier", "build_classifier", "use_small_input_strides"]


class InputNormalization(nn.Module):
    """``(x - mean) / std`` per channel; mean and std are persistent buffers of shape (1, C, 1, 1)."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        super().__init__()
        mean_t = torch.as_tensor(mean, dtype=torch.float32).flatten()
        std_t = torch.as_tensor(std, dtype=torch.float32).flatten()
        if mean_t.numel() != std_t.numel():
            raise UserError(f"mean has {mean_t.numel()} values but std has {std_t.numel()}; expected one per channel")
        if not bool((std_t > 0).all()):
            raise UserError(f"std must be positive, got {std_t.tolist()}")
        self.register_buffer("mean", mean_t.view(1, -1, 1, 1))
        self.register_buffer("std", std_t.view(1, -1, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def extra_repr(self) -> str:
        def fmt(t: torch.Tensor) -> str:
            return "(" + ", ".join(f"{v:.4g}" for v in t.flatten().tolist()) + ")"

        return f"mean={fmt(self.mean)}, std={fmt(self.std)}"


class RobustClassifier(nn.Module):
    """Takes images in [0, 1] and returns logits: ``net(normalize(x))``.

    ``normalize`` is an InputNormalization, or nn.Identity when the net takes raw [0, 1] input (as the
    released models of Singh et al. do). ``net`` is the timm model. Keep both attribute names: checkpoints and
    ``checkpoints.read_state_dict`` rely on the ``normalize.`` / ``net.`` key prefixes.
    """

    def __init__(self, net: nn.Module, mean: Sequence[float] | None = None, std: Sequence[float] | None = None):
        super().__init__()
        if (mean is None) != (std is None):
            raise UserError(f"mean and std must both be set or both be None (got mean={mean!r}, std={std!r})")
        # (std is None only with mean: checked above)
        self.normalize: nn.Module = nn.Identity() if mean is None or std is None else InputNormalization(mean, std)
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.net(self.normalize(x))
        return logits


def _unknown_arch_error(arch: str) -> UserError:
    base = arch.split(".", 1)[0]
    close = difflib.get_close_matches(base, timm.list_models(), n=5, cutoff=0.6)
    hint = f" Close matches: {', '.join(close)}." if close else ""
    return UserError(
        f"unknown architecture {arch!r}: expected a timm model name (see timm.list_models('{base[:8]}*')) "
        f"or one registered by robust_lightning.models.{hint}"
    )


def build_classifier(
    arch: str,
    num_classes: int,
    image_size: int | None = None,
    mean: Sequence[float] | None = None,
    std: Sequence[float] | None = None,
    arch_kwargs: dict[str, Any] | None = None,
) -> RobustClassifier:
    """Create ``timm.create_model(arch, pretrained=False, num_classes=num_classes, **arch_kwargs)`` and wrap it.

    ``arch`` may carry a pretrained tag (``convnext_tiny.fb_in1k``): the tag only selects timm's config, weights
    always come from ``weights.load_pretrained`` (never a download). ``image_size`` is passed as ``img_size`` to
    architectures that take it (ViTs build their position embedding for it) unless ``arch_kwargs`` sets it.
    """
    arch_kwargs = dict(arch_kwargs or {})
    if (mean is None) != (std is None):
        raise UserError(f"mean and std must both be set or both be None (got mean={mean!r}, std={std!r})")
    for key in ("pretrained", "num_classes"):
        if key in arch_kwargs:
            raise UserError(
                f"arch_kwargs must not set {key!r}: num_classes is its own argument and weights come from a "
                "local checkpoint via warm start"
            )
    if ":" in arch:
        # 'hf-hub:...' would fetch a config from the network; the project builds offline from timm's registry.
        raise UserError(f"architecture {arch!r} names a model source; expected a plain timm model name")
    if not timm.is_model(arch):
        raise _unknown_arch_error(arch)

    def create(**extra: Any) -> nn.Module:
        try:
            return timm.create_model(arch, pretrained=False, num_classes=num_classes, **arch_kwargs, **extra)
        except RuntimeError as e:
            if "pretrained tag" in str(e).lower() or "invalid pretrained" in str(e).lower():
                raise UserError(f"unknown pretrained tag in {arch!r}: {e}") from e
            raise

    if image_size is not None and "img_size" not in arch_kwargs:
        # timm has no uniform way to ask whether a model takes img_size (it is swallowed by **kwargs in many
        # entrypoints), so try it and fall back when the constructor rejects exactly that keyword. The
        # rejection happens at call time, before any weights are allocated, so the retry is cheap.
        try:
            net = create(img_size=image_size)
        except TypeError as e:
            if "img_size" not in str(e):
                raise
            net = create()
    else:
        net = create()
    return RobustClassifier(net, mean=mean, std=std)


def use_small_input_strides(net: nn.Module) -> nn.Module:
    """Adapt a ConvNeXt (PatchStem or ConvStem) to 32x32 inputs as the paper does for CIFAR transfer: stride 1
    in the stem convs and in the first downsampling layer, so the last stage still sees a 7x7 map, not 1x1.
    Strides carry no weights, so warm-started weights load unchanged."""
    stem, stages = getattr(net, "stem", None), getattr(net, "stages", None)
    if stem is None or stages is None or not isinstance(getattr(stages[1], "downsample", None), nn.Sequential):
        raise UserError(
            f"small-input strides are defined for ConvNeXt models (stem + stages); "
            f"{type(net).__name__} has no such layout"
        )
    for conv in [*stem.modules(), *stages[1].downsample.modules()]:
        if isinstance(conv, nn.Conv2d):
            conv.stride = (1, 1)
    return net
