"""Isotropic ConvNeXt-S of Liu et al. 2022 ("A ConvNet for the 2020s", Sec. 3.3), with and without ConvStem.

Architecture of Liu et al.'s ``convnext_isotropic_small`` (facebookresearch/ConvNeXt, models/convnext_isotropic.py):
patchify Conv16x16/16 3->384 with no norm after it, 18 ConvNeXt blocks of width 384 at 1/16 resolution,
global average pool, LayerNorm (eps 1e-6), linear head: 22.3M parameters with 1000 classes.

Layer scale: Liu et al. train the isotropic models with it off (``layer_scale_init_value=0``), so the default
here is ``ls_init_value=None`` (no ``gamma``); pass ``ls_init_value=1e-6`` to add it (18 x 384 extra params).

Registered with timm: ``convnext_iso_small`` and ``convnext_iso_small_convstem`` (the ViT ConvStem
3->48->96->192->384 then Conv1x1 384->384 in place of the patchify conv, as Singh et al. use it). All keys
outside ``stem.`` are identical between the two. The blocks are timm's ``ConvNeXtBlock``; a filter maps
Liu et al.'s checkpoint names (dwconv / pwconv1 / pwconv2) for timm's pretrained-file loading.
"""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import torch
from timm.layers import trunc_normal_
from timm.models import build_model_with_cfg, checkpoint_seq, generate_default_cfgs, register_model
from timm.models.convnext import ConvNeXtBlock
from torch import nn

from robust_lightning.models.convstem import VIT_STEM_CHANNELS, ConvStem
from robust_lightning.models.timm_api import DeviceDtype, GroupMatcher, LinearHeadMixin, jit_ignore, pretrained_cfg

__all__ = ["IsotropicConvNeXt"]


class IsotropicConvNeXt(LinearHeadMixin, nn.Module):
    """ConvNeXt without downsampling stages: one stem to 1/16, ``depth`` blocks of width ``dim``."""

    def __init__(
        self,
        in_chans: int = 3,
        num_classes: int = 1000,
        dim: int = 384,
        depth: int = 18,
        stem_type: str = "patch",
        patch_size: int = 16,
        ls_init_value: float | None = None,
        global_pool: str = "avg",
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        head_init_scale: float = 1.0,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        dd: DeviceDtype = {"device": device, "dtype": dtype}
        if stem_type not in ("patch", "convstem"):
            raise ValueError(f"stem_type must be 'patch' or 'convstem', got {stem_type!r}")
        if global_pool not in ("avg", ""):
            raise ValueError(f"global_pool must be 'avg' or '', got {global_pool!r}")
        self.num_classes = num_classes
        self.in_chans = in_chans
        self.global_pool = global_pool
        self.drop_rate = drop_rate
        self.num_features = self.head_hidden_size = dim
        self.grad_checkpointing = False

        if stem_type == "patch":
            self.stem: nn.Module = nn.Conv2d(in_chans, dim, kernel_size=patch_size, stride=patch_size, **dd)
        else:
            if patch_size != 16:
                raise ValueError("the ConvStem reduces by 16; patch_size must be 16")
            self.stem = ConvStem(in_chans, VIT_STEM_CHANNELS, (2, 2, 2, 2), out_dim=dim, **dd)

        dp_rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # linear, as in Liu et al.
        self.blocks = nn.Sequential(
            *[ConvNeXtBlock(dim, ls_init_value=ls_init_value, drop_path=dp_rates[i], **dd) for i in range(depth)]
        )
        self.norm = nn.LayerNorm(dim, eps=1e-6, **dd)  # applied after pooling, as in Liu et al.
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(dim, num_classes, **dd) if num_classes > 0 else nn.Identity()
        self.feature_info = [dict(num_chs=dim, reduction=patch_size, module=f"blocks.{i}") for i in range(depth)]

        self._init_weights(head_init_scale)

    def _init_weights(self, head_init_scale: float) -> None:
        # Liu et al.: trunc_normal(0.02) weights, zero biases. A ConvStem keeps PyTorch's default init, as in all
        # ConvStem models of this package (see ConvStem).
        for name, m in self.named_modules():
            if isinstance(self.stem, ConvStem) and name.startswith("stem"):
                continue
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        if isinstance(self.head, nn.Linear):
            self.head.weight.data.mul_(head_init_scale)
            self.head.bias.data.mul_(head_init_scale)

    @jit_ignore
    def group_matcher(self, coarse: bool = False) -> GroupMatcher:
        # parameter groups for timm's layer-wise lr decay: stem, one group per block, then the final norm
        return dict(stem=r"^stem", blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    @jit_ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Unpooled features (N, dim, H/16, W/16), like timm's forward_features."""
        x = self.stem(x)
        if self.grad_checkpointing and not torch.jit.is_scripting():
            features: torch.Tensor = checkpoint_seq(self.blocks, x)
        else:
            features = self.blocks(x)
        return features

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        if self.global_pool == "avg":
            x = x.mean(dim=(-2, -1))
            x = self.norm(x)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))


def checkpoint_filter_fn(state_dict: dict[str, Any], model: nn.Module) -> dict[str, Any]:
    """Map Liu et al.'s isotropic checkpoints (facebookresearch/ConvNeXt) to this module's names."""
    state_dict = state_dict.get("model", state_dict)
    out = {}
    for k, v in state_dict.items():
        k = re.sub(r"^blocks\.(\d+)\.dwconv\.", r"blocks.\1.conv_dw.", k)
        k = re.sub(r"^blocks\.(\d+)\.pwconv(\d)\.", r"blocks.\1.mlp.fc\2.", k)
        out[k] = v
    return out


_cfg = partial(pretrained_cfg, first_conv="stem", classifier="head", paper_ids="arXiv:2201.03545", pool_size=(14, 14))


# register_model reads the module-level ``default_cfgs`` of the module that defines the entrypoint.
default_cfgs = generate_default_cfgs(
    {
        "convnext_iso_small": _cfg(),
        "convnext_iso_small_convstem": _cfg(first_conv="stem.0", paper_ids="arXiv:2303.01870"),
    }
)


def _create(variant: str, pretrained: bool, **kwargs: Any) -> IsotropicConvNeXt:
    return build_model_with_cfg(
        IsotropicConvNeXt,
        variant,
        pretrained,
        pretrained_filter_fn=checkpoint_filter_fn,
        **kwargs,
    )


@register_model
def convnext_iso_small(pretrained: bool = False, **kwargs: Any) -> IsotropicConvNeXt:
    """ConvNeXt-S (iso.) of Liu et al.: patchify 16x16/16 -> 18 blocks of width 384 (22.3M params)."""
    return _create("convnext_iso_small", pretrained, **dict(dict(dim=384, depth=18), **kwargs))


@register_model
def convnext_iso_small_convstem(pretrained: bool = False, **kwargs: Any) -> IsotropicConvNeXt:
    """ConvNeXt-S (iso.) with the ViT ConvStem (Singh et al.): 3->48->96->192->384, 1x1 384->384."""
    model_args = dict(dim=384, depth=18, stem_type="convstem")
    return _create("convnext_iso_small_convstem", pretrained, **dict(model_args, **kwargs))
