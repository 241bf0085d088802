"""ConvStem: the convolutional stem of Singh, Croce & Hein (NeurIPS 2023) for ConvNeXt and ViT.

The paper replaces the patchify stem ("PatchStem": one large-stride conv) by a few 3x3 convolutions, each
followed by a channels-first LayerNorm and GELU (Singh et al. 2023, App. A; nmndeep/revisiting-at
utils_architecture.py). Everything after the stem is the unchanged timm architecture, so the non-stem keys of a ConvStem
model equal those of its PatchStem counterpart and a clean PatchStem checkpoint can warm-start it (see
``weights.load_pretrained``).

Registered with timm (``timm.create_model(name, num_classes=..., ...)``):

- ``convnext_{tiny,small,base,large}_convstem``: timm ConvNeXt of that size, ``stem`` replaced.
- ``convnext_atto_convstem``: NOT from the paper; timm's convnext_atto with a T/S-pattern stem
  (3->20 /2, 20->40 /2) for quick starts and tests.
- ``vit_{small,medium,base}_patch16_224_convstem``: timm VisionTransformer, ``patch_embed.proj`` replaced.
  ViT-M is DeiT-III medium (embed 512, 8 heads, layer scale, no_embed_class) as in the paper.
- the stem ablations of App. B (Tables 7-9): ``convnext_tiny_stem_*``, ``convnext_base_stem_c1`` and
  ``vit_small_patch16_224_stem_c2`` .. ``_c5`` (see the tables' dicts at the end of this module).

No pretrained weights are registered (no url / hub id), so nothing here can trigger a download. A local file
still works through timm's own mechanism: ``pretrained=True, pretrained_cfg_overlay=dict(file=PATH)``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD
from timm.layers import LayerNorm2d, PatchEmbed, to_2tuple
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.convnext import ConvNeXt
from timm.models.convnext import checkpoint_filter_fn as convnext_filter_fn
from timm.models.vision_transformer import VisionTransformer
from timm.models.vision_transformer import checkpoint_filter_fn as vit_filter_fn
from torch import nn

from robust_lightning.models.timm_api import DeviceDtype, PretrainedCfgDict, pretrained_cfg

__all__ = [
    "CONVSTEM_PATCHSTEM_PAIRS",
    "CONVSTEM_STEM_PREFIX",
    "ConvNeXtConvStem",
    "ConvStem",
    "ConvStemPatchEmbed",
    "find_convstem_prefix",
]

# Each ConvStem model and the timm PatchStem model whose clean checkpoint warm-starts it (paper, App. A).
CONVSTEM_PATCHSTEM_PAIRS: dict[str, str] = {
    "convnext_atto_convstem": "convnext_atto",
    "convnext_tiny_convstem": "convnext_tiny",
    "convnext_small_convstem": "convnext_small",
    "convnext_base_convstem": "convnext_base",
    "convnext_large_convstem": "convnext_large",
    "vit_small_patch16_224_convstem": "vit_small_patch16_224",  # same arch as deit_small_patch16_224
    "vit_medium_patch16_224_convstem": "deit3_medium_patch16_224",
    "vit_base_patch16_224_convstem": "vit_base_patch16_224",
    # defined in isotropic_convnext.py
    "convnext_iso_small_convstem": "convnext_iso_small",
}

# Prefix of the stem parameters in the state dict: these are the keys that differ between the two stems.
CONVSTEM_STEM_PREFIX: dict[str, str] = {
    name: ("patch_embed.proj." if name.startswith("vit_") else "stem.") for name in CONVSTEM_PATCHSTEM_PAIRS
}

# The stem of ViT and isotropic ConvNeXt: four 3x3/2 convs (overall stride 16), then a 1x1 conv to the width.
VIT_STEM_CHANNELS = (48, 96, 192, 384)


class ConvStem(nn.Sequential):
    """Conv -> LayerNorm2d -> GELU, repeated per entry of ``channels``; optionally a final Conv1x1.

    Each conv has its stride and kernel size (3 unless ``kernel_sizes`` says otherwise, as the paper's stems;
    the other sizes serve the stem ablations of its Tables 7 and 9). Padding (k - s + 1) // 2 keeps the output at
    input / stride (1 for the 3x3 convs, as the reference's), for any kernel.

    An ``nn.Sequential`` so the state-dict keys are plain indices (``0.weight`` conv, ``1.weight`` LN, ...).
    These indices are the same as in the reference implementation (nmndeep/revisiting-at), whose stems sit one
    level deeper (``stem.stem.0.weight``); ``weights.load_pretrained`` maps that layout.

    The layers keep PyTorch's default initialisation: in the reference the stem was swapped into an already
    initialised timm model, so it never saw the host model's init scheme.
    """

    def __init__(
        self,
        in_chans: int,
        channels: Sequence[int],
        strides: Sequence[int],
        out_dim: int | None = None,
        norm_eps: float = 1e-6,
        kernel_sizes: Sequence[int] | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        kernel_sizes = (3,) * len(channels) if kernel_sizes is None else tuple(kernel_sizes)
        if not len(channels) == len(strides) == len(kernel_sizes):
            raise ValueError(
                f"ConvStem needs one stride and kernel size per conv, got channels={channels} "
                f"strides={strides} kernel_sizes={kernel_sizes}"
            )
        dd: DeviceDtype = {"device": device, "dtype": dtype}
        layers: list[nn.Module] = []
        prev = in_chans
        for ch, stride, kernel in zip(channels, strides, kernel_sizes):
            layers += [
                nn.Conv2d(
                    prev, ch, kernel_size=kernel, stride=stride, padding=(kernel - stride + 1) // 2, bias=True, **dd
                ),
                LayerNorm2d(ch, eps=norm_eps, **dd),
                nn.GELU(),
            ]
            prev = ch
        if out_dim is not None:
            layers.append(nn.Conv2d(prev, out_dim, kernel_size=1, stride=1, padding=0, bias=True, **dd))
            prev = out_dim
        super().__init__(*layers)
        self.out_chs = prev
        self.stride = 1
        for s in strides:
            self.stride *= s


def find_convstem_prefix(model: nn.Module) -> str | None:
    """State-dict prefix of the ConvStem inside ``model`` (e.g. ``"stem."``), or None if it has none."""
    for name, module in model.named_modules():
        if isinstance(module, ConvStem):
            return f"{name}." if name else ""
    return None


# ---------------------------------------------------------------------------------------------------------
# ConvNeXt + ConvStem


class ConvNeXtConvStem(ConvNeXt):
    """timm ConvNeXt whose ``stem`` (4x4/4 conv + LN) is a ConvStem with the same output (dims[0] ch at 1/4).

    A subclass (rather than swapping the stem after ``timm.create_model``) so that timm's own pretrained
    loading (``pretrained_cfg_overlay=dict(file=...)``) sees the final architecture.
    """

    def __init__(
        self,
        stem_channels: Sequence[int],
        stem_strides: Sequence[int],
        stem_kernels: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        stem = ConvStem(
            kwargs.get("in_chans", 3),
            stem_channels,
            stem_strides,
            kernel_sizes=stem_kernels,
            device=kwargs.get("device"),
            dtype=kwargs.get("dtype"),
        )
        # the stages (and feature_info) expect what the patchify stem gave: dims[0] channels at stride 4
        dims = kwargs.get("dims", (96, 192, 384, 768))
        if stem.out_chs != dims[0] or stem.stride != 4:
            raise ValueError(
                f"ConvStem must give dims[0]={dims[0]} channels at stride 4, got {stem.out_chs} at {stem.stride}"
            )
        self.stem = stem


_convnext_cfg = partial(pretrained_cfg, first_conv="stem.0", classifier="head.fc", paper_ids="arXiv:2303.01870")


def _vit_cfg(**kwargs: Any) -> PretrainedCfgDict:
    return {
        "url": "",
        "num_classes": 1000,
        "input_size": (3, 224, 224),
        "pool_size": None,
        "crop_pct": 0.9,
        "interpolation": "bicubic",
        "fixed_input_size": True,
        "mean": IMAGENET_INCEPTION_MEAN,
        "std": IMAGENET_INCEPTION_STD,
        "first_conv": "patch_embed.proj.0",
        "classifier": "head",
        "paper_ids": "arXiv:2303.01870",
        **kwargs,
    }


# register_model reads the module-level ``default_cfgs`` of the module that defines the entrypoint.
default_cfgs = generate_default_cfgs(
    {
        "convnext_atto_convstem": _convnext_cfg(paper_ids=""),  # project variant, not from the paper
        "convnext_tiny_convstem": _convnext_cfg(),
        "convnext_small_convstem": _convnext_cfg(),
        "convnext_base_convstem": _convnext_cfg(),
        "convnext_large_convstem": _convnext_cfg(),
        "vit_small_patch16_224_convstem": _vit_cfg(),
        # DeiT-III medium was trained with ImageNet default mean/std
        "vit_medium_patch16_224_convstem": _vit_cfg(mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD),
        "vit_base_patch16_224_convstem": _vit_cfg(),
    }
)


def _create_convnext_convstem(
    variant: str,
    pretrained: bool,
    stem_channels: Sequence[int],
    stem_strides: Sequence[int],
    stem_kernels: Sequence[int] | None = None,
    **kwargs: Any,
) -> ConvNeXt:
    return build_model_with_cfg(
        ConvNeXtConvStem,
        variant,
        pretrained,
        pretrained_filter_fn=convnext_filter_fn,
        feature_cfg=dict(out_indices=(0, 1, 2, 3), flatten_sequential=True),
        stem_channels=stem_channels,
        stem_strides=stem_strides,
        stem_kernels=stem_kernels,
        **kwargs,
    )


@register_model
def convnext_atto_convstem(pretrained: bool = False, **kwargs: Any) -> ConvNeXt:
    """Project variant (not in the paper): timm convnext_atto, stem 3->20 /2, 20->40 /2 (T/S pattern)."""
    model_args = dict(depths=(2, 2, 6, 2), dims=(40, 80, 160, 320), conv_mlp=True)
    return _create_convnext_convstem(
        "convnext_atto_convstem", pretrained, (20, 40), (2, 2), **dict(model_args, **kwargs)
    )


@register_model
def convnext_tiny_convstem(pretrained: bool = False, **kwargs: Any) -> ConvNeXt:
    """ConvNeXt-T + ConvStem: 3->48 /2, 48->96 /2."""
    model_args = dict(depths=(3, 3, 9, 3), dims=(96, 192, 384, 768))
    return _create_convnext_convstem(
        "convnext_tiny_convstem", pretrained, (48, 96), (2, 2), **dict(model_args, **kwargs)
    )


@register_model
def convnext_small_convstem(pretrained: bool = False, **kwargs: Any) -> ConvNeXt:
    """ConvNeXt-S + ConvStem: 3->48 /2, 48->96 /2."""
    model_args = dict(depths=(3, 3, 27, 3), dims=(96, 192, 384, 768))
    return _create_convnext_convstem(
        "convnext_small_convstem", pretrained, (48, 96), (2, 2), **dict(model_args, **kwargs)
    )


@register_model
def convnext_base_convstem(pretrained: bool = False, **kwargs: Any) -> ConvNeXt:
    """ConvNeXt-B + ConvStem: 3->64 /2, 64->96 /2, 96->128 /1."""
    model_args = dict(depths=(3, 3, 27, 3), dims=(128, 256, 512, 1024))
    return _create_convnext_convstem(
        "convnext_base_convstem", pretrained, (64, 96, 128), (2, 2, 1), **dict(model_args, **kwargs)
    )


@register_model
def convnext_large_convstem(pretrained: bool = False, **kwargs: Any) -> ConvNeXt:
    """ConvNeXt-L + ConvStem: 3->96 /2, 96->144 /2, 144->192 /1."""
    model_args = dict(depths=(3, 3, 27, 3), dims=(192, 384, 768, 1536))
    return _create_convnext_convstem(
        "convnext_large_convstem", pretrained, (96, 144, 192), (2, 2, 1), **dict(model_args, **kwargs)
    )


# ---------------------------------------------------------------------------------------------------------
# ViT + ConvStem


class ConvStemPatchEmbed(PatchEmbed):
    """timm PatchEmbed whose ``proj`` is the ViT ConvStem (four 3x3/2 convs, then 1x1 to ``embed_dim``).

    Subclassing keeps PatchEmbed's img_size / grid_size / num_patches bookkeeping, its strict size check and
    its flatten to tokens; only the projection changes. The four stride-2 convs give the same 16x reduction
    as the 16x16 patchify conv, so ``patch_size`` must stay 16.
    """

    def __init__(
        self,
        *args: Any,
        stem_channels: Sequence[int] = VIT_STEM_CHANNELS,
        stem_strides: Sequence[int] | None = None,
        stem_kernels: Sequence[int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        strides = (2,) * len(stem_channels) if stem_strides is None else tuple(stem_strides)
        stride = math.prod(strides)
        if self.patch_size != (stride, stride):
            raise ValueError(f"the ConvStem reduces by {stride}; patch_size must be {stride}, got {self.patch_size}")
        if self.dynamic_img_pad:
            raise ValueError("ConvStemPatchEmbed does not support dynamic_img_pad")
        # the stem in place of timm's patchifying conv (which PatchEmbed declares an nn.Conv2d)
        self.proj = ConvStem(  # type: ignore[assignment]
            self.proj.in_channels,
            stem_channels,
            strides,
            kernel_sizes=stem_kernels,
            out_dim=self.proj.out_channels,
            device=self.proj.weight.device,
            dtype=self.proj.weight.dtype,
        )

    def set_input_size(
        self, img_size: int | tuple[int, int] | None = None, patch_size: int | tuple[int, int] | None = None
    ) -> None:
        # PatchEmbed would resample a 16x16 kernel here; the ConvStem has a fixed reduction of 16.
        if patch_size is not None and tuple(to_2tuple(patch_size)) != self.patch_size:
            raise ValueError("the patch size of a ConvStem ViT is fixed by its stem and cannot be changed")
        super().set_input_size(img_size=img_size)


def _create_vit_convstem(
    variant: str, pretrained: bool, stem: Mapping[str, tuple[int, ...]] | None = None, **kwargs: Any
) -> VisionTransformer:
    """``stem``: ConvStemPatchEmbed's stem_channels / stem_strides / stem_kernels (default: the paper's ViT stem)."""
    # deit3 checkpoints store layer scale as gamma_1/gamma_2; the ViT filter maps them (timm's _create_deit does too)
    # and resamples pos_embed to the model's grid when loading via timm's pretrained mechanism.
    filter_fn = lambda sd, model: vit_filter_fn(sd, model, adapt_layer_scale=True)  # noqa: E731
    return build_model_with_cfg(
        VisionTransformer,
        variant,
        pretrained,
        pretrained_filter_fn=filter_fn,
        feature_cfg=dict(out_indices=kwargs.pop("out_indices", 3), feature_cls="getter"),
        embed_layer=partial(ConvStemPatchEmbed, **(stem or {})),
        **kwargs,
    )


@register_model
def vit_small_patch16_224_convstem(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """ViT-S/16 (= DeiT-S arch) + ConvStem 3->48->96->192->384, 1x1 384->384."""
    model_args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
    return _create_vit_convstem("vit_small_patch16_224_convstem", pretrained, **dict(model_args, **kwargs))


@register_model
def vit_medium_patch16_224_convstem(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """ViT-M = DeiT-III medium (embed 512, 8 heads, layer scale, no_embed_class) + ConvStem, 1x1 384->512."""
    model_args = dict(patch_size=16, embed_dim=512, depth=12, num_heads=8, no_embed_class=True, init_values=1e-6)
    return _create_vit_convstem("vit_medium_patch16_224_convstem", pretrained, **dict(model_args, **kwargs))


@register_model
def vit_base_patch16_224_convstem(pretrained: bool = False, **kwargs: Any) -> VisionTransformer:
    """ViT-B/16 + ConvStem 3->48->96->192->384, 1x1 384->768."""
    model_args = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12)
    return _create_vit_convstem("vit_base_patch16_224_convstem", pretrained, **dict(model_args, **kwargs))


# ---------------------------------------------------------------------------------------------------------
# The stem ablations of Singh et al., App. B. Layers as the tables write them: (width, stride, kernel), each
# conv followed by LayerNorm and GELU. The tables give no widths for ConvNeXt-T's rows: 48 then 96, the widths
# of its final ConvStem, which the FLOPs of Table 7 bear out (tests/test_models.py).

StemLayers = tuple[tuple[int, int, int], ...]  # (width, stride, kernel) per conv

# Table 7 (ConvNeXt-T); its first row (Conv4,4, L) is timm's convnext_tiny, its last convnext_tiny_convstem.
CONVNEXT_TINY_STEM_ABLATIONS: dict[str, StemLayers] = {
    "convnext_tiny_stem_c7s4": ((96, 4, 7),),
    "convnext_tiny_stem_c7s4_c3s1": ((48, 4, 7), (96, 1, 3)),
    "convnext_tiny_stem_c7s2_c3s2": ((48, 2, 7), (96, 2, 3)),
    "convnext_tiny_stem_c5s2_c3s2": ((48, 2, 5), (96, 2, 3)),
}
# Table 8 (ConvNeXt-B, N = 64): C1 N*-2N*; P1 is timm's convnext_base, C2 (N*-1.5N*-2N) convnext_base_convstem.
CONVNEXT_BASE_STEM_ABLATIONS: dict[str, StemLayers] = {"convnext_base_stem_c1": ((64, 2, 3), (128, 2, 3))}
# Table 9 (ViT-S, N = 48; *: kernel 3 stride 2, **: kernel 7 stride 4, none: kernel 3 stride 1), then a 1x1 conv
# to the embedding as every ViT ConvStem here; P1 is timm's vit_small_patch16_224, C1 vit_small_patch16_224_convstem.
VIT_SMALL_STEM_ABLATIONS: dict[str, StemLayers] = {
    "vit_small_patch16_224_stem_c2": ((48, 2, 3), (48, 2, 3), (48, 2, 3), (384, 2, 3)),
    "vit_small_patch16_224_stem_c3": ((48, 4, 7), (384, 4, 7)),
    "vit_small_patch16_224_stem_c4": ((48, 4, 7), (96, 2, 3), (192, 2, 3), (384, 1, 3)),
    "vit_small_patch16_224_stem_c5": ((48, 4, 7), (96, 4, 7), (192, 1, 3), (384, 1, 3)),
}


def _stem_args(layers: StemLayers) -> dict[str, tuple[int, ...]]:
    widths, strides, kernels = zip(*layers)
    return {"stem_channels": widths, "stem_strides": strides, "stem_kernels": kernels}


def _register_stem_ablations() -> None:
    """Registers each ablation stem with timm under its name, with the PatchStem model that warm-starts it."""
    tiny = dict(depths=(3, 3, 9, 3), dims=(96, 192, 384, 768))
    base = dict(depths=(3, 3, 27, 3), dims=(128, 256, 512, 1024))
    specs = [(name, layers, "convnext_tiny", tiny) for name, layers in CONVNEXT_TINY_STEM_ABLATIONS.items()]
    specs += [(name, layers, "convnext_base", base) for name, layers in CONVNEXT_BASE_STEM_ABLATIONS.items()]
    for name, layers, patchstem, model_args in specs:

        def entrypoint(
            pretrained: bool = False,
            name: str = name,
            layers: StemLayers = layers,
            model_args: Mapping[str, tuple[int, ...]] = model_args,
            **kwargs: Any,
        ) -> ConvNeXt:
            return _create_convnext_convstem(name, pretrained, **_stem_args(layers), **dict(model_args, **kwargs))

        _register(name, entrypoint, _convnext_cfg(), patchstem, "stem.")
    vit = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
    for name, layers in VIT_SMALL_STEM_ABLATIONS.items():

        def vit_entrypoint(
            pretrained: bool = False, name: str = name, layers: StemLayers = layers, **kwargs: Any
        ) -> VisionTransformer:
            return _create_vit_convstem(name, pretrained, stem=_stem_args(layers), **dict(vit, **kwargs))

        _register(name, vit_entrypoint, _vit_cfg(), "vit_small_patch16_224", "patch_embed.proj.")


def _register(
    name: str, entrypoint: Callable[..., nn.Module], cfg: PretrainedCfgDict, patchstem: str, stem_prefix: str
) -> None:
    entrypoint.__name__ = entrypoint.__qualname__ = name
    entrypoint.__doc__ = f"Singh et al. App. B stem ablation {name} (robust_lightning.models.convstem)."
    default_cfgs.update(generate_default_cfgs({name: cfg}))
    register_model(entrypoint)
    CONVSTEM_PATCHSTEM_PAIRS[name] = patchstem
    CONVSTEM_STEM_PREFIX[name] = stem_prefix


_register_stem_ablations()
