"""RepLKNet: Ding et al., "Scaling Up Your Kernels to 31x31: Revisiting Large Kernel Design in CNNs" (CVPR 2022,
arXiv:2203.06717; reference implementation DingXiaoH/RepLKNet-pytorch). Studied for robustness by Chen et al.
(ICML 2024, "Revealing the Dark Secrets of Extremely Large Kernel ConvNets on Robustness", Lauch1ng/LKRobust).

Architecture (every "conv" below is Conv2d without bias followed by BatchNorm2d):

- stem (to 1/4): conv3x3/2 3->C0 +ReLU, depthwise conv3x3 +ReLU, conv1x1 +ReLU, depthwise conv3x3/2 +ReLU.
- 4 stages of ``layers[i]`` block pairs at width ``channels[i]``; ``stages[i].blocks`` lists the residual
  blocks in order: RepLKBlock, ConvFFN, RepLKBlock, ConvFFN, ...

  * RepLKBlock: x + DropPath(pw2(ReLU(large_kernel(pw1(BN(x)))))), pw1 = conv1x1 +ReLU, pw2 = conv1x1, and
    ``large_kernel`` a ``ReparamLargeKernelConv``: depthwise KxK conv (``lkb_origin``) plus a parallel depthwise
    5x5 conv (``small_conv``), outputs summed.
  * ConvFFN: x + DropPath(pw2(GELU(pw1(BN(x))))), conv1x1 C->4C and 4C->C.

- transitions between stages: conv1x1 C_i->C_{i+1} +ReLU, depthwise conv3x3/2 +ReLU.
- head: BatchNorm, global average pool, linear.

RepLKNet-31B: kernels 31/29/27/13, layers 2/2/18/2, channels 128/256/512/1024 (79M parameters in the paper);
RepLKNet-31L: same with channels 192/384/768/1536 (172M). Drop path is linear over the block pairs.

Structural re-parameterisation: the small branch exists for training only. ``reparameterize(model)`` (or
``model.reparameterize()``) folds each BatchNorm into its conv and zero-pads the 5x5 kernel into the large one,
leaving one depthwise KxK conv with bias (``lkb_reparam``) that gives the same outputs in eval mode (BatchNorm
with running statistics). timm's ``reparameterize_model`` works too (it calls ``reparameterize()``).

``features_only`` is not supported (stages and transitions interleave): hook ``stages[i]`` for stage outputs.
Parameter names equal the reference implementation's, so its checkpoints (unmerged, or merged with
``small_kernel_merged=True``) load unchanged. Initialisation is PyTorch's default, as in the reference.
Registered with timm: ``replknet_31b``, ``replknet_31l`` and the small ``replknet_test`` (not from the paper, for
tests). No pretrained weights are registered, so nothing here downloads.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from timm.layers import DropPath
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from torch import nn

from robust_lightning.models.timm_api import (
    BlockStage,
    DeviceDtype,
    GroupMatcher,
    LinearHeadMixin,
    jit_ignore,
    pretrained_cfg,
)

__all__ = ["ConvFFN", "RepLKBlock", "RepLKNet", "RepLKNetStage", "ReparamLargeKernelConv", "reparameterize"]


class ConvBN(nn.Sequential):
    """Conv2d (no bias) -> BatchNorm2d [-> ReLU]; submodule names ``conv``, ``bn``, ``nonlinear`` as in the
    reference, so checkpoint keys match."""

    def __init__(
        self,
        in_chs: int,
        out_chs: int,
        kernel_size: int,
        stride: int = 1,
        groups: int = 1,
        relu: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd: DeviceDtype = {"device": device, "dtype": dtype}
        self.conv = nn.Conv2d(in_chs, out_chs, kernel_size, stride, kernel_size // 2, groups=groups, bias=False, **dd)
        self.bn = nn.BatchNorm2d(out_chs, **dd)
        if relu:
            self.nonlinear = nn.ReLU()


def fuse_conv_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel and bias of one conv equivalent to ``bn(conv(x))`` with the BN's running statistics."""
    assert bn.running_var is not None and bn.running_mean is not None  # nn.BatchNorm2d's default: tracked
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    return conv.weight * scale.reshape(-1, 1, 1, 1), bn.bias - bn.running_mean * scale


class ReparamLargeKernelConv(nn.Module):
    """Depthwise KxK conv + BN with a parallel depthwise small-kernel conv + BN (training form), or after
    ``reparameterize()`` one depthwise KxK conv with bias (``lkb_reparam``, inference form).

    Stride 1, 'same' padding. ``kernel_size`` / ``small_kernel`` say which form the weights have; the kernel an
    analysis wants is ``lkb_origin.conv.weight`` (the large branch as trained) or ``equivalent_kernel_bias()``.
    """

    def __init__(
        self,
        channels: int,
        kernel_size: int,
        small_kernel: int | None,
        merged: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd: DeviceDtype = {"device": device, "dtype": dtype}
        if kernel_size % 2 == 0 or (small_kernel is not None and (small_kernel % 2 == 0 or small_kernel > kernel_size)):
            raise ValueError(f"kernels must be odd with small <= large, got {kernel_size} and {small_kernel}")
        self.channels = channels
        self.kernel_size = kernel_size
        self.small_kernel = small_kernel
        self.lkb_origin = self.small_conv = self.lkb_reparam = None
        if merged:
            self.lkb_reparam = nn.Conv2d(channels, channels, kernel_size, 1, kernel_size // 2, groups=channels, **dd)
        else:
            self.lkb_origin = ConvBN(channels, channels, kernel_size, groups=channels, **dd)
            if small_kernel is not None:
                self.small_conv = ConvBN(channels, channels, small_kernel, groups=channels, **dd)

    @property
    def is_merged(self) -> bool:
        return self.lkb_reparam is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lkb_reparam is not None:
            merged: torch.Tensor = self.lkb_reparam(x)
            return merged
        assert self.lkb_origin is not None  # the training form
        out: torch.Tensor = self.lkb_origin(x)
        if self.small_conv is not None:
            out = out + self.small_conv(x)
        return out

    @torch.no_grad()
    def equivalent_kernel_bias(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(C, 1, K, K) kernel and (C,) bias of the single conv this module equals in eval mode."""
        if self.lkb_reparam is not None:
            assert self.lkb_reparam.bias is not None  # made with a bias
            return self.lkb_reparam.weight.clone(), self.lkb_reparam.bias.clone()
        assert self.lkb_origin is not None  # the training form
        kernel, bias = fuse_conv_bn(self.lkb_origin.conv, self.lkb_origin.bn)
        if self.small_conv is not None:
            assert self.small_kernel is not None  # the small branch exists with its size
            small_kernel, small_bias = fuse_conv_bn(self.small_conv.conv, self.small_conv.bn)
            pad = (self.kernel_size - self.small_kernel) // 2
            kernel = kernel + F.pad(small_kernel, [pad] * 4)  # both centred: the small kernel sits in the middle
            bias = bias + small_bias
        return kernel, bias

    @torch.no_grad()
    def reparameterize(self) -> None:
        """Replace both branches by one conv with bias (no-op when already merged)."""
        if self.lkb_reparam is not None:
            return
        kernel, bias = self.equivalent_kernel_bias()
        conv = nn.Conv2d(
            self.channels,
            self.channels,
            self.kernel_size,
            1,
            self.kernel_size // 2,
            groups=self.channels,
            device=kernel.device,
            dtype=kernel.dtype,
        )
        conv.weight.copy_(kernel)
        assert conv.bias is not None  # made with a bias
        conv.bias.copy_(bias)
        self.lkb_reparam = conv
        self.lkb_origin = self.small_conv = None


class RepLKBlock(nn.Module):
    """Pre-BN residual block around the large depthwise kernel (``large_kernel``)."""

    def __init__(
        self,
        channels: int,
        dw_channels: int,
        kernel_size: int,
        small_kernel: int | None,
        drop_path: float = 0.0,
        small_kernel_merged: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd: DeviceDtype = {"device": device, "dtype": dtype}
        self.prelkb_bn = nn.BatchNorm2d(channels, **dd)
        self.pw1 = ConvBN(channels, dw_channels, 1, relu=True, **dd)
        self.large_kernel = ReparamLargeKernelConv(dw_channels, kernel_size, small_kernel, small_kernel_merged, **dd)
        self.lk_nonlinear = nn.ReLU()
        self.pw2 = ConvBN(dw_channels, channels, 1, **dd)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.pw1(self.prelkb_bn(x))
        out = self.pw2(self.lk_nonlinear(self.large_kernel(out)))
        residual: torch.Tensor = self.drop_path(out)
        return x + residual


class ConvFFN(nn.Module):
    """Pre-BN residual 1x1-conv MLP (the Transformer FFN as convolutions)."""

    def __init__(
        self,
        channels: int,
        hidden_channels: int,
        drop_path: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd: DeviceDtype = {"device": device, "dtype": dtype}
        self.preffn_bn = nn.BatchNorm2d(channels, **dd)
        self.pw1 = ConvBN(channels, hidden_channels, 1, **dd)
        self.nonlinear = nn.GELU()
        self.pw2 = ConvBN(hidden_channels, channels, 1, **dd)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        residual: torch.Tensor = self.drop_path(self.pw2(self.nonlinear(self.pw1(self.preffn_bn(x)))))
        return x + residual


class RepLKNetStage(BlockStage):
    """``blocks``: RepLKBlock, ConvFFN, RepLKBlock, ConvFFN, ... (two residual blocks per layer)."""

    def __init__(
        self,
        channels: int,
        num_layers: int,
        kernel_size: int,
        small_kernel: int | None,
        drop_path: Sequence[float],
        dw_ratio: float = 1.0,
        ffn_ratio: float = 4.0,
        small_kernel_merged: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        dd: DeviceDtype = {"device": device, "dtype": dtype}
        blocks: list[nn.Module] = []
        for i in range(num_layers):
            blocks.append(
                RepLKBlock(
                    channels,
                    int(channels * dw_ratio),
                    kernel_size,
                    small_kernel,
                    drop_path[i],
                    small_kernel_merged,
                    **dd,
                )
            )
            blocks.append(ConvFFN(channels, int(channels * ffn_ratio), drop_path[i], **dd))
        super().__init__(blocks)


class RepLKNet(LinearHeadMixin, nn.Module):
    """RepLKNet classifier with the timm model API (forward_features / forward_head / reset_classifier)."""

    def __init__(
        self,
        large_kernel_sizes: Sequence[int] = (31, 29, 27, 13),
        layers: Sequence[int] = (2, 2, 18, 2),
        channels: Sequence[int] = (128, 256, 512, 1024),
        small_kernel: int | None = 5,
        dw_ratio: float = 1.0,
        ffn_ratio: float = 4.0,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        small_kernel_merged: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd: DeviceDtype = {"device": device, "dtype": dtype}
        if not len(large_kernel_sizes) == len(layers) == len(channels):
            raise ValueError("large_kernel_sizes, layers and channels need one entry per stage")
        if global_pool not in ("avg", ""):
            raise ValueError(f"global_pool must be 'avg' or '', got {global_pool!r}")
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.drop_rate = drop_rate
        self.num_features = self.head_hidden_size = channels[-1]

        c0 = channels[0]
        self.stem = nn.Sequential(
            ConvBN(in_chans, c0, 3, stride=2, relu=True, **dd),
            ConvBN(c0, c0, 3, groups=c0, relu=True, **dd),
            ConvBN(c0, c0, 1, relu=True, **dd),
            ConvBN(c0, c0, 3, stride=2, groups=c0, relu=True, **dd),
        )
        dpr = torch.linspace(0, drop_path_rate, sum(layers)).tolist()  # one rate per block pair, as in the reference
        self.stages = nn.ModuleList()
        self.transitions = nn.ModuleList()
        self.feature_info = []
        for i, (kernel, n, ch) in enumerate(zip(large_kernel_sizes, layers, channels)):
            self.stages.append(
                RepLKNetStage(
                    ch,
                    n,
                    kernel,
                    small_kernel,
                    dpr[sum(layers[:i]) : sum(layers[: i + 1])],
                    dw_ratio,
                    ffn_ratio,
                    small_kernel_merged,
                    **dd,
                )
            )
            self.feature_info.append(dict(num_chs=ch, reduction=4 * 2**i, module=f"stages.{i}"))
            if i < len(layers) - 1:
                nxt = channels[i + 1]
                self.transitions.append(
                    nn.Sequential(
                        ConvBN(ch, nxt, 1, relu=True, **dd),
                        ConvBN(nxt, nxt, 3, stride=2, groups=nxt, relu=True, **dd),
                    )
                )
        self.norm = nn.BatchNorm2d(channels[-1], **dd)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(channels[-1], num_classes, **dd) if num_classes > 0 else nn.Identity()

    @jit_ignore
    def group_matcher(self, coarse: bool = False) -> GroupMatcher:
        # stage i and the transition after it form one group for layer-wise lr decay
        return dict(
            stem=r"^stem", blocks=[(r"^stages\.(\d+)", None), (r"^transitions\.(\d+)", None), (r"^norm", (99999,))]
        )

    @jit_ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for stage in self.stages:
            # a plain attribute of the stage: nn.Module.__setattr__ is typed for tensors and modules only
            stage.grad_checkpointing = enable  # type: ignore[assignment]

    def reparameterize(self) -> RepLKNet:
        """Merge every large/small kernel pair for inference (in place); see ``reparameterize``."""
        return reparameterize(self)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Unpooled features (N, C, H/32, W/32) after the final BatchNorm."""
        x = self.stem(x)
        for i, stage in enumerate(self.stages):
            x = stage(x)
            if i < len(self.transitions):
                x = self.transitions[i](x)
        features: torch.Tensor = self.norm(x)
        return features

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=(-2, -1))
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def reparameterize(model: ModuleT) -> ModuleT:
    """Merge every ``ReparamLargeKernelConv`` inside ``model`` (any wrapper) in place and return ``model``.

    The merged model equals the unmerged one in eval mode only (the BatchNorms are folded with their running
    statistics); train-mode batch statistics are gone afterwards, so do this for inference / analysis.
    """
    for module in model.modules():
        if isinstance(module, ReparamLargeKernelConv):
            module.reparameterize()
    return model


_cfg = partial(pretrained_cfg, first_conv="stem.0.conv", classifier="head", paper_ids="arXiv:2203.06717")


default_cfgs = generate_default_cfgs(
    {
        "replknet_31b": _cfg(),
        "replknet_31l": _cfg(input_size=(3, 384, 384), pool_size=(12, 12), crop_pct=1.0),  # trained at 384 px
        "replknet_test": _cfg(input_size=(3, 64, 64), pool_size=(2, 2), paper_ids=""),
    }
)


def _create(variant: str, pretrained: bool, **kwargs: Any) -> RepLKNet:
    if kwargs.get("features_only"):
        # timm's feature wrappers run the top-level modules in order; stages and transitions interleave
        raise ValueError("RepLKNet does not support features_only; hook model.stages[i] for stage outputs")
    return build_model_with_cfg(RepLKNet, variant, pretrained, **kwargs)


@register_model
def replknet_31b(pretrained: bool = False, **kwargs: Any) -> RepLKNet:
    """RepLKNet-31B: kernels 31/29/27/13, layers 2/2/18/2, channels 128/256/512/1024, small kernel 5 (79M)."""
    model_args = dict(large_kernel_sizes=(31, 29, 27, 13), layers=(2, 2, 18, 2), channels=(128, 256, 512, 1024))
    return _create("replknet_31b", pretrained, **dict(model_args, **kwargs))


@register_model
def replknet_31l(pretrained: bool = False, **kwargs: Any) -> RepLKNet:
    """RepLKNet-31L: as 31B with channels 192/384/768/1536 (172M)."""
    model_args = dict(large_kernel_sizes=(31, 29, 27, 13), layers=(2, 2, 18, 2), channels=(192, 384, 768, 1536))
    return _create("replknet_31l", pretrained, **dict(model_args, **kwargs))


@register_model
def replknet_test(pretrained: bool = False, **kwargs: Any) -> RepLKNet:
    """Small RepLKNet for tests (not from the paper): kernels 7/7/5/5 with a parallel 3x3, one layer per stage."""
    model_args = dict(large_kernel_sizes=(7, 7, 5, 5), layers=(1, 1, 1, 1), channels=(16, 24, 32, 48), small_kernel=3)
    return _create("replknet_test", pretrained, **dict(model_args, **kwargs))
