"""Pieces of timm's model API shared by the project's own architectures."""

from collections.abc import Callable
from typing import Any, TypedDict, TypeVar

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import checkpoint_seq
from torch import nn

# timm's pretrained_cfg as a mapping (generate_default_cfgs turns it into a PretrainedCfg): values of many types
PretrainedCfgDict = dict[str, Any]


class DeviceDtype(TypedDict):
    """The factory arguments of a module's parameters, passed on to each layer: ``**dd``."""

    device: torch.device | str | None
    dtype: torch.dtype | None


# group_matcher's answer, for timm's layer-wise lr decay: a group's name -> its pattern, or (pattern, ordinal) pairs
GroupMatcher = dict[str, str | list[tuple[str, tuple[int, ...] | None]]]

_Method = TypeVar("_Method", bound=Callable[..., object])


def jit_ignore(method: _Method) -> _Method:
    """``@torch.jit.ignore`` (TorchScript leaves the method to Python) with the method's own type: torch's
    decorator is untyped."""
    ignored: _Method = torch.jit.ignore(method)  # type: ignore[no-untyped-call]  # torch leaves it untyped
    return ignored


def pretrained_cfg(*, first_conv: str, classifier: str, paper_ids: str, **overrides: Any) -> PretrainedCfgDict:
    """timm's pretrained_cfg for an architecture registered here: ImageNet-1k at 224 px, crop 0.875, bicubic,
    ImageNet mean/std, a 7 x 7 final map; ``overrides`` change any of these. No URL: nothing may download,
    weights come from local files."""
    return {
        "url": "",
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": (7, 7),
        "crop_pct": 0.875,
        "interpolation": "bicubic",
        "mean": IMAGENET_DEFAULT_MEAN,
        "std": IMAGENET_DEFAULT_STD,
        "first_conv": first_conv,
        "classifier": classifier,
        "paper_ids": paper_ids,
        **overrides,
    }


class LinearHeadMixin:
    """``get_classifier`` / ``reset_classifier`` for a model with ``self.head`` (a Linear on ``num_features``
    pooled features, or Identity), ``self.norm`` (whose weight gives device and dtype) and ``global_pool``."""

    head: nn.Module
    norm: nn.Module
    num_features: int

    @jit_ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        self.num_classes = num_classes
        if global_pool is not None:
            if global_pool not in ("avg", ""):
                raise ValueError(f"global_pool must be 'avg' or '', got {global_pool!r}")
            self.global_pool = global_pool
        w = self.norm.weight
        self.head = (
            nn.Linear(self.num_features, num_classes, device=w.device, dtype=w.dtype)
            if num_classes > 0
            else nn.Identity()
        )


class BlockStage(nn.Module):
    """A stage of residual ``blocks`` run in order, with timm's gradient checkpointing switch."""

    def __init__(self, blocks: list[nn.Module]):
        super().__init__()
        self.blocks = nn.Sequential(*blocks)
        self.grad_checkpointing = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.grad_checkpointing and not torch.jit.is_scripting():
            out: torch.Tensor = checkpoint_seq(self.blocks, x)
        else:
            out = self.blocks(x)
        return out
