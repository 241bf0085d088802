"""ConvNeXt with a configurable depthwise kernel size (odd, 3 to 51).

Chen et al. (ICML 2024, "Revealing the Dark Secrets of Extremely Large Kernel ConvNets on Robustness",
Lauch1ng/LKRobust) compare ConvNeXt models whose depthwise kernel ranges from 3 to 51 with RepLKNet. ConvNeXt
(Liu et al. 2022, arXiv:2201.03545) uses 7x7; nothing else changes with the kernel size: the depthwise conv keeps
stride 1 and 'same' zero padding (K // 2), so every other weight shape is that of the timm model of the same size.

These are timm's own ``ConvNeXt`` (its ``kernel_sizes`` argument); the entrypoints name the family, check the
kernel size and take it as ``kernel_size`` (one odd int for all stages, or four, one per stage):
``model.arch: convnext_tiny_lk`` with ``model.arch_kwargs: {kernel_size: 51}``. Registered:
``convnext_{tiny,small,base}_lk`` (default kernel 31) and ``convnext_lk_test`` (small, for tests; default 7).
No pretrained weights are registered, so nothing here downloads.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.convnext import ConvNeXt, checkpoint_filter_fn

from robust_lightning.models.timm_api import pretrained_cfg

__all__ = ["KERNEL_SIZE_RANGE", "check_kernel_sizes"]

KERNEL_SIZE_RANGE = (3, 51)


def check_kernel_sizes(kernel_size: int | tuple[int, ...]) -> tuple[int, int, int, int]:
    """One kernel size per stage; each must be odd (centred 'same' padding) and within KERNEL_SIZE_RANGE."""
    sizes = (kernel_size,) * 4 if isinstance(kernel_size, int) else tuple(kernel_size)
    lo, hi = KERNEL_SIZE_RANGE
    if len(sizes) != 4 or any(not isinstance(k, int) or k % 2 == 0 or not lo <= k <= hi for k in sizes):
        raise ValueError(f"kernel_size must be an odd int in [{lo}, {hi}] or four of them, got {kernel_size!r}")
    return sizes


_cfg = partial(pretrained_cfg, first_conv="stem.0", classifier="head.fc", paper_ids="arXiv:2407.08972")


default_cfgs = generate_default_cfgs(
    {
        "convnext_tiny_lk": _cfg(),
        "convnext_small_lk": _cfg(),
        "convnext_base_lk": _cfg(),
        "convnext_lk_test": _cfg(input_size=(3, 64, 64), pool_size=(2, 2), paper_ids=""),
    }
)


def _create(
    variant: str,
    pretrained: bool,
    kernel_size: int | tuple[int, ...],
    model_args: Mapping[str, tuple[int, ...]],
    kwargs: dict[str, Any],
) -> ConvNeXt:
    if "kernel_sizes" in kwargs:
        raise ValueError(f"{variant} takes kernel_size, not kernel_sizes")
    return build_model_with_cfg(
        ConvNeXt,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=(0, 1, 2, 3), flatten_sequential=True),
        **dict(model_args, kernel_sizes=check_kernel_sizes(kernel_size), **kwargs),
    )


@register_model
def convnext_tiny_lk(pretrained: bool = False, kernel_size: int | tuple[int, ...] = 31, **kwargs: Any) -> ConvNeXt:
    """ConvNeXt-T (depths 3/3/9/3, dims 96..768) with a KxK depthwise kernel."""
    model_args = dict(depths=(3, 3, 9, 3), dims=(96, 192, 384, 768))
    return _create("convnext_tiny_lk", pretrained, kernel_size, model_args, kwargs)


@register_model
def convnext_small_lk(pretrained: bool = False, kernel_size: int | tuple[int, ...] = 31, **kwargs: Any) -> ConvNeXt:
    """ConvNeXt-S (depths 3/3/27/3, dims 96..768) with a KxK depthwise kernel."""
    model_args = dict(depths=(3, 3, 27, 3), dims=(96, 192, 384, 768))
    return _create("convnext_small_lk", pretrained, kernel_size, model_args, kwargs)


@register_model
def convnext_base_lk(pretrained: bool = False, kernel_size: int | tuple[int, ...] = 31, **kwargs: Any) -> ConvNeXt:
    """ConvNeXt-B (depths 3/3/27/3, dims 128..1024) with a KxK depthwise kernel."""
    model_args = dict(depths=(3, 3, 27, 3), dims=(128, 256, 512, 1024))
    return _create("convnext_base_lk", pretrained, kernel_size, model_args, kwargs)


@register_model
def convnext_lk_test(pretrained: bool = False, kernel_size: int | tuple[int, ...] = 7, **kwargs: Any) -> ConvNeXt:
    """Small ConvNeXt for tests (not from the paper): one block per stage, dims 16/24/32/48."""
    model_args = dict(depths=(1, 1, 1, 1), dims=(16, 24, 32, 48))
    return _create("convnext_lk_test", pretrained, kernel_size, model_args, kwargs)
