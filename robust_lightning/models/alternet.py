"""AlterNet: Park & Kim, "How Do Vision Transformers Work?" (ICLR 2022, arXiv:2202.06709; reference
implementation xxxnell/how-do-vits-work, models/alternet.py).

A pre-activation ResNet whose Conv blocks at the end of each stage are replaced, alternately, by MSA blocks
(build-up rule: "alternately replace Conv blocks with MSA blocks from the end of a baseline CNN"). A stage of
n blocks with m MSA blocks is  C ... C  (C M) x m, e.g. AlterNet-50 (blocks 3/4/6/4, MSA 0/1/3/2):

    stage 0: C C C      stage 1: C C C M      stage 2: C M C M C M      stage 3: C M C M

- stem: conv7x7/2 3->64 (no bias), maxpool 3x3/2. No norm: the first block's pre-activation normalises.
- Conv block (``PreActBottleneck``): BN-ReLU-conv1x1-BN-ReLU-conv3x3(stride)-BN-ReLU-conv1x1 (width c -> 4c);
  the shortcut is a 1x1 conv (stride) on the pre-activated input where the shape changes.
- MSA block (``MSABlock``): x + DropPath(attn(BN(conv1x1(GELU(BN(x)))))), the 1x1 conv reducing 4c -> c;
  ``attn`` (``WindowAttention2d``) is multi-head self-attention over the spatial positions inside 7x7
  windows with a learned relative position bias, head dim 64, output projection heads*64 -> 4c. Heads per stage
  3/6/12/24. As in the reference the MSA block has no MLP: the Conv block before it plays the MLP's part
  (the paper: one MLP block per MSA block, as in a Transformer).
- head: BN, ReLU, global average pool, linear.

Differences from the reference, both without effect at default settings: stochastic depth (``drop_path_rate``,
default 0, linear over blocks) applies to every block, not only to MSA blocks; feature maps whose side is not a
multiple of the window are zero-padded with the padded keys masked (the reference requires a multiple).

Structure for analyses: ``stages[i].blocks`` are the residual blocks in order; MSA blocks are ``MSABlock`` with
``.attn``; ``attn`` maps c to 4c channels, so removing the attention means replacing the whole block by an
identity (its residual branch is the attention path). ``features_only=True`` works. Registered with timm:
``alternet_50`` and the small ``alternet_test`` (not from the paper, for tests). Initialisation is PyTorch's
default, as in the reference. No pretrained weights are registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

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

__all__ = ["AlterNet", "AlterNetStage", "MSABlock", "PreActBottleneck", "WindowAttention2d", "msa_layout"]

EXPANSION = 4  # bottleneck: block output = 4 x block width


def msa_layout(num_blocks: int, num_msa: int) -> list[bool]:
    """Which blocks of a stage are MSA blocks: Conv blocks first, then (Conv, MSA) pairs at the end."""
    if not 0 <= 2 * num_msa <= num_blocks:
        raise ValueError(f"a stage of {num_blocks} blocks holds at most {num_blocks // 2} MSA blocks, got {num_msa}")
    return [False] * (num_blocks - 2 * num_msa) + [False, True] * num_msa


class PreActBottleneck(nn.Module):
    """Pre-activation ResNet bottleneck (He et al. 2016, "Identity Mappings in Deep Residual Networks")."""

    def __init__(
        self,
        in_chs: int,
        width: int,
        stride: int = 1,
        drop_path: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd: DeviceDtype = {"device": device, "dtype": dtype}
        out_chs = width * EXPANSION
        self.shortcut = None
        if stride != 1 or in_chs != out_chs:
            self.shortcut = nn.Conv2d(in_chs, out_chs, 1, stride, bias=False, **dd)
        self.bn1 = nn.BatchNorm2d(in_chs, **dd)
        self.conv1 = nn.Conv2d(in_chs, width, 1, bias=False, **dd)
        self.bn2 = nn.BatchNorm2d(width, **dd)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False, **dd)
        self.bn3 = nn.BatchNorm2d(width, **dd)
        self.conv3 = nn.Conv2d(width, out_chs, 1, bias=False, **dd)
        self.act = nn.ReLU()
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.act(self.bn1(x))
        skip = x if self.shortcut is None else self.shortcut(out)  # a projection sees the pre-activated input
        out = self.conv1(out)
        out = self.conv2(self.act(self.bn2(out)))
        out = self.conv3(self.act(self.bn3(out)))
        residual: torch.Tensor = self.drop_path(out)
        return skip + residual


class WindowAttention2d(nn.Module):
    """Multi-head self-attention over the positions of each non-overlapping ``window_size`` x ``window_size``
    window of an (N, C, H, W) map, with a learned relative position bias shared by the heads.

    q, k, v are 1x1 convs without bias (``to_q``, ``to_kv``); ``to_out`` is a 1x1 conv with bias to ``out_chs``.
    """

    def __init__(
        self,
        in_chs: int,
        out_chs: int,
        num_heads: int,
        head_dim: int = 64,
        window_size: int = 7,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd: DeviceDtype = {"device": device, "dtype": dtype}
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.window_size = window_size
        self.scale = head_dim**-0.5
        inner = num_heads * head_dim
        self.to_q = nn.Conv2d(in_chs, inner, 1, bias=False, **dd)
        self.to_kv = nn.Conv2d(in_chs, 2 * inner, 1, bias=False, **dd)
        self.to_out = nn.Conv2d(inner, out_chs, 1, **dd)
        # bias[dy, dx] for the offset (key - query) + window_size - 1 in each direction
        self.pos_embedding = nn.Parameter(torch.randn(2 * window_size - 1, 2 * window_size - 1, **dd) * 0.02)

    def relative_position_bias(self) -> torch.Tensor:
        """(P, P) bias added to the attention logits, P = window_size**2 positions in row-major order."""
        p = self.window_size
        idx = torch.arange(p, device=self.pos_embedding.device)
        coords = torch.stack(torch.meshgrid(idx, idx, indexing="ij")).flatten(1)  # (2, P): row, col
        offset = coords[:, None, :] - coords[:, :, None] + p - 1  # [., query, key] = key - query + p - 1
        return self.pos_embedding[offset[0], offset[1]]

    def _to_windows(self, t: torch.Tensor) -> torch.Tensor:
        # (N, heads*d, H, W) -> (N * windows, heads, P, d)
        n, _, h, w = t.shape
        p = self.window_size
        t = t.view(n, self.num_heads, self.head_dim, h // p, p, w // p, p)
        return t.permute(0, 3, 5, 1, 4, 6, 2).reshape(-1, self.num_heads, p * p, self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        p = self.window_size
        pad_h, pad_w = -h % p, -w % p
        if pad_h or pad_w:
            x = F.pad(x, (0, pad_w, 0, pad_h))
        hp, wp = h + pad_h, w + pad_w
        k, v = self.to_kv(x).chunk(2, dim=1)
        q, k, v = (self._to_windows(t) for t in (self.to_q(x), k, v))

        logits = (q @ k.transpose(-2, -1)) * self.scale + self.relative_position_bias()
        if pad_h or pad_w:
            # padded positions must not be attended to; every window holds at least one real position
            real = torch.zeros(1, 1, hp, wp, device=x.device, dtype=torch.bool)
            real[..., :h, :w] = True
            real = real.view(1, 1, hp // p, p, wp // p, p).permute(0, 2, 4, 1, 3, 5).reshape(-1, 1, 1, p * p)
            logits = logits.view(n, -1, self.num_heads, p * p, p * p)
            logits = logits.masked_fill(~real, float("-inf")).flatten(0, 1)
        out = logits.softmax(dim=-1) @ v  # explicit attention: supports double backward (Hessian analyses)

        # (N * windows, heads, P, d) -> (N, heads*d, H, W)
        out = out.view(n, hp // p, wp // p, self.num_heads, p, p, self.head_dim)
        out = out.permute(0, 3, 6, 1, 4, 2, 5).reshape(n, self.num_heads * self.head_dim, hp, wp)
        projected: torch.Tensor = self.to_out(out[..., :h, :w])
        return projected


class MSABlock(nn.Module):
    """AlterNet's MSA block (pre-activation): x + DropPath(attn(norm2(conv(act(norm1(x))))))."""

    def __init__(
        self,
        chs: int,
        num_heads: int,
        head_dim: int = 64,
        window_size: int = 7,
        drop_path: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd: DeviceDtype = {"device": device, "dtype": dtype}
        width = chs // EXPANSION
        self.norm1 = nn.BatchNorm2d(chs, **dd)
        self.act = nn.GELU()
        self.conv = nn.Conv2d(chs, width, 1, bias=False, **dd)
        self.norm2 = nn.BatchNorm2d(width, **dd)
        self.attn = WindowAttention2d(width, chs, num_heads, head_dim, window_size, **dd)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.norm2(self.conv(self.act(self.norm1(x))))
        residual: torch.Tensor = self.drop_path(self.attn(out))
        return x + residual


class AlterNetStage(BlockStage):
    def __init__(
        self,
        in_chs: int,
        width: int,
        stride: int,
        is_msa: Sequence[bool],
        num_heads: int,
        head_dim: int,
        window_size: int,
        drop_path: Sequence[float],
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        dd: DeviceDtype = {"device": device, "dtype": dtype}
        blocks: list[nn.Module] = []
        for i, msa in enumerate(is_msa):
            if msa:  # never first in a stage (msa_layout), so input and output shapes agree
                blocks.append(MSABlock(width * EXPANSION, num_heads, head_dim, window_size, drop_path[i], **dd))
            else:
                blocks.append(PreActBottleneck(in_chs, width, stride if i == 0 else 1, drop_path[i], **dd))
            in_chs = width * EXPANSION
        super().__init__(blocks)


class AlterNet(LinearHeadMixin, nn.Module):
    """AlterNet classifier with the timm model API (forward_features / forward_head / reset_classifier)."""

    def __init__(
        self,
        num_blocks: Sequence[int] = (3, 4, 6, 4),
        num_msa: Sequence[int] = (0, 1, 3, 2),
        widths: Sequence[int] = (64, 128, 256, 512),
        num_heads: Sequence[int] = (3, 6, 12, 24),
        head_dim: int = 64,
        window_size: int = 7,
        stem_chs: int = 64,
        in_chans: int = 3,
        num_classes: int = 1000,
        global_pool: str = "avg",
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd: DeviceDtype = {"device": device, "dtype": dtype}
        if not len(num_blocks) == len(num_msa) == len(widths) == len(num_heads):
            raise ValueError("num_blocks, num_msa, widths and num_heads need one entry per stage")
        if global_pool not in ("avg", ""):
            raise ValueError(f"global_pool must be 'avg' or '', got {global_pool!r}")
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.drop_rate = drop_rate
        self.num_features = self.head_hidden_size = widths[-1] * EXPANSION

        self.stem = nn.Sequential(
            nn.Conv2d(in_chans, stem_chs, 7, 2, 3, bias=False, **dd),
            nn.MaxPool2d(3, 2, 1),
        )
        dpr = torch.linspace(0, drop_path_rate, sum(num_blocks)).tolist()
        stages = []
        self.feature_info = []
        in_chs = stem_chs
        for i, (n, m, width, heads) in enumerate(zip(num_blocks, num_msa, widths, num_heads)):
            stride = 1 if i == 0 else 2
            stages.append(
                AlterNetStage(
                    in_chs,
                    width,
                    stride,
                    msa_layout(n, m),
                    heads,
                    head_dim,
                    window_size,
                    dpr[sum(num_blocks[:i]) : sum(num_blocks[: i + 1])],
                    **dd,
                )
            )
            in_chs = width * EXPANSION
            self.feature_info.append(dict(num_chs=in_chs, reduction=4 * 2**i, module=f"stages.{i}"))
        self.stages = nn.Sequential(*stages)
        self.norm = nn.BatchNorm2d(in_chs, **dd)  # pre-activation nets end with BN-ReLU before pooling
        self.act = nn.ReLU()
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(in_chs, num_classes, **dd) if num_classes > 0 else nn.Identity()

    @jit_ignore
    def group_matcher(self, coarse: bool = False) -> GroupMatcher:
        return dict(stem=r"^stem", blocks=[(r"^stages\.(\d+)\.blocks\.(\d+)", None), (r"^norm", (99999,))])

    @jit_ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        for stage in self.stages:
            # a plain attribute of the stage: nn.Module.__setattr__ is typed for tensors and modules only
            stage.grad_checkpointing = enable  # type: ignore[assignment]

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Unpooled features (N, C, H/32, W/32) after the final BN-ReLU."""
        features: torch.Tensor = self.act(self.norm(self.stages(self.stem(x))))
        return features

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=(-2, -1))
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


_cfg = partial(pretrained_cfg, first_conv="stem.0", classifier="head", paper_ids="arXiv:2202.06709")


default_cfgs = generate_default_cfgs(
    {
        "alternet_50": _cfg(),
        "alternet_test": _cfg(input_size=(3, 64, 64), pool_size=(2, 2), paper_ids=""),
    }
)


def _create(variant: str, pretrained: bool, **kwargs: Any) -> AlterNet:
    return build_model_with_cfg(
        AlterNet, variant, pretrained, feature_cfg=dict(out_indices=(0, 1, 2, 3), flatten_sequential=True), **kwargs
    )


@register_model
def alternet_50(pretrained: bool = False, **kwargs: Any) -> AlterNet:
    """AlterNet-50: blocks 3/4/6/4, MSA blocks 0/1/3/2 (alternating at the stage ends), heads 3/6/12/24."""
    model_args = dict(
        num_blocks=(3, 4, 6, 4), num_msa=(0, 1, 3, 2), widths=(64, 128, 256, 512), num_heads=(3, 6, 12, 24)
    )
    return _create("alternet_50", pretrained, **dict(model_args, **kwargs))


@register_model
def alternet_test(pretrained: bool = False, **kwargs: Any) -> AlterNet:
    """Small AlterNet for tests (not from the paper): blocks 1/2/2/2, one MSA block at the end of stages 1-3,
    widths 8/16/24/32, 2x2 windows (divide the 16/8/4/2 maps of a 64 px input)."""
    model_args = dict(
        num_blocks=(1, 2, 2, 2),
        num_msa=(0, 1, 1, 1),
        widths=(8, 16, 24, 32),
        num_heads=(1, 1, 2, 2),
        head_dim=8,
        window_size=2,
        stem_chs=16,
    )
    return _create("alternet_test", pretrained, **dict(model_args, **kwargs))
