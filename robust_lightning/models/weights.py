"""Warm-starting a RobustClassifier from a checkpoint, and loading a released model by name (``load_model``).

The files are read by ``robust_lightning.models.checkpoints``. Warm start (``load_pretrained``) is strict: every
tensor of the net is either loaded with the exact shape or explained in the report. The one expected exception is
a ConvStem model warm-started from its PatchStem counterpart (paper: non-stem layers from the clean PatchStem
model, stem random), and optionally a new head.
"""

from __future__ import annotations

import math
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
from timm.layers import resample_abs_pos_embed
from timm.models.convnext import ConvNeXt
from timm.models.convnext import checkpoint_filter_fn as convnext_filter_fn
from timm.models.swin_transformer import SwinTransformer
from timm.models.swin_transformer import checkpoint_filter_fn as swin_filter_fn
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from robust_lightning.errors import UserError
from robust_lightning.models.checkpoints import (
    CheckpointWeights,
    read_checkpoint,
)
from robust_lightning.models.classifier import (
    InputNormalization,
    RobustClassifier,
    build_classifier,
    use_small_input_strides,
)
from robust_lightning.models.convstem import find_convstem_prefix
from robust_lightning.models.isotropic_convnext import IsotropicConvNeXt
from robust_lightning.models.isotropic_convnext import checkpoint_filter_fn as iso_filter_fn
from robust_lightning.models.robustbench import PREFIX, is_robustbench_arch, resolve_arch, robustbench_entry

__all__ = [
    "WarmStartReport",
    "adopt_normalizer",
    "load_model",
    "load_pretrained",
]

MAX_LISTED_KEYS = 20


@dataclass
class WarmStartReport:
    """What ``load_pretrained`` did; ``str(report)`` is a short human summary."""

    loaded: list[str]
    newly_initialized: list[str]
    dropped: list[str]
    source: str
    notes: list[str] = field(default_factory=list)
    # the normaliser buffers stored in the checkpoint ({'mean', 'std'}), for the caller to compare with its own
    checkpoint_normalize: dict[str, torch.Tensor] = field(default_factory=dict)

    def __str__(self) -> str:
        parts = [f"loaded {len(self.loaded)} tensors from {self.source}"]
        if self.newly_initialized:
            parts.append(f"newly initialised: {_short_list(self.newly_initialized, 8)}")
        if self.dropped:
            parts.append(f"dropped from checkpoint: {_short_list(self.dropped, 8)}")
        parts += self.notes
        return "; ".join(parts)


def _short_list(keys: list[str], limit: int) -> str:
    head = ", ".join(keys[:limit])
    return head + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def _arch_name(net: nn.Module) -> str:
    cfg = getattr(net, "pretrained_cfg", None) or {}
    return cfg.get("architecture") or type(net).__name__


def _adapt_foreign_layout(
    net: nn.Module, sd: dict[str, torch.Tensor], stem_prefix: str | None, notes: list[str]
) -> dict[str, torch.Tensor]:
    """Rename keys of the original (non-timm) releases our models are warm-started from."""
    if stem_prefix is not None:
        # nmndeep/revisiting-at nests its ConvStem one level deeper (stem.stem.0.weight,
        # patch_embed.proj.stem.0.weight) with the same layer order as ours: drop that level.
        nested = f"{stem_prefix}stem."
        if any(k.startswith(nested) for k in sd):
            sd = {(stem_prefix + k[len(nested) :] if k.startswith(nested) else k): v for k, v in sd.items()}
            notes.append("ConvStem keys mapped from the revisiting-at layout")
    if isinstance(net, ConvNeXt) and any(k.startswith("downsample_layers.") for k in sd):
        # facebookresearch/ConvNeXt names -> timm (timm's filter has no annotations)
        sd = convnext_filter_fn(sd, net)  # type: ignore[no-untyped-call]
        notes.append("keys mapped from the facebookresearch/ConvNeXt layout")
    elif isinstance(net, VisionTransformer) and any(re.search(r"\.gamma_[12]$", k) for k in sd):
        sd = {re.sub(r"\.gamma_([12])$", r".ls\1.gamma", k): v for k, v in sd.items()}  # DeiT-III release
        notes.append("layer-scale keys mapped from the DeiT-III layout")
    elif isinstance(net, IsotropicConvNeXt) and any(".dwconv." in k or ".pwconv" in k for k in sd):
        sd = iso_filter_fn(sd, net)  # Liu et al.'s isotropic release
        notes.append("keys mapped from the facebookresearch/ConvNeXt isotropic layout")
    elif isinstance(net, SwinTransformer) and any(
        k == "head.weight" or k.endswith((".relative_position_index", ".attn_mask")) for k in sd
    ):
        sd = swin_filter_fn(sd, net)  # Swin checkpoints of older timm / microsoft/Swin-Transformer
        notes.append("keys mapped from the older Swin layout")
    return sd


def _resample_pos_embed(net: nn.Module, src: torch.Tensor, notes: list[str]) -> torch.Tensor:
    """Resample a ViT pos_embed from another grid to the net's grid (timm's resample_abs_pos_embed)."""
    target = cast(torch.Tensor, net.pos_embed)
    grid = getattr(getattr(net, "patch_embed", None), "grid_size", None)
    if src.ndim != 3 or target.ndim != 3 or src.shape[-1] != target.shape[-1] or grid is None:
        return src  # not resamplable; reported as a shape mismatch
    num_prefix = 0 if getattr(net, "no_embed_class", False) else getattr(net, "num_prefix_tokens", 1)
    side = math.isqrt(src.shape[1] - num_prefix)
    if side * side != src.shape[1] - num_prefix:
        return src
    out: torch.Tensor = resample_abs_pos_embed(
        src, new_size=list(grid), old_size=[side, side], num_prefix_tokens=num_prefix
    )
    notes.append(f"pos_embed resampled from a {side}x{side} to a {grid[0]}x{grid[1]} grid")
    return out


def _classifier_prefix(net: nn.Module) -> str | None:
    if not hasattr(net, "get_classifier"):
        return None
    head = cast(Callable[[], nn.Module], net.get_classifier)()
    for name, module in net.named_modules():
        if module is head and name:
            return f"{name}."
    return None


def load_pretrained(
    model: nn.Module,
    path: str | Path | CheckpointWeights,
    allow_new_stem: bool = True,
    *,
    new_head: bool = False,
    prefer_ema: bool = False,
) -> WarmStartReport:
    """Load a checkpoint into ``model.net`` (a RobustClassifier; a bare net works too) with strict checks.

    - Keys and shapes must match exactly, except:
    - ConvStem model + checkpoint with a different stem (its PatchStem counterpart) and ``allow_new_stem``:
      all non-stem tensors are loaded, the ConvStem keeps its fresh init (``newly_initialized``) and the
      checkpoint's stem tensors are ``dropped``.
    - ``new_head``: the classifier keeps its fresh init (transfer to another label set).
    - ViT ``pos_embed`` of another grid size is resampled to the net's grid.
    Anything else raises UserError listing the mismatched keys and naming the expected architecture.
    The normaliser of ``model`` is not touched; the checkpoint's one is in ``report.checkpoint_normalize``
    (``adopt_normalizer`` takes it over). ``path`` may also be what ``read_checkpoint`` returned.
    """
    net = getattr(model, "net", model)
    ckpt = path if isinstance(path, CheckpointWeights) else read_checkpoint(path, prefer_ema=prefer_ema)
    target = net.state_dict()
    stem_prefix = find_convstem_prefix(net)
    notes: list[str] = []
    src = _adapt_foreign_layout(net, ckpt.state_dict, stem_prefix, notes)

    if "pos_embed" in src and "pos_embed" in target and src["pos_embed"].shape != target["pos_embed"].shape:
        src = dict(src, pos_embed=_resample_pos_embed(net, src["pos_embed"], notes))

    missing = [k for k in target if k not in src]
    unexpected = [k for k in src if k not in target]
    mismatched = [k for k in target if k in src and src[k].shape != target[k].shape]

    # Keys under these prefixes may legitimately disagree; they keep the net's fresh init.
    fresh_prefixes: dict[str, str] = {}
    if new_head:
        head_prefix = _classifier_prefix(net)
        if head_prefix:
            fresh_prefixes[head_prefix] = "new head"
    if stem_prefix is not None and allow_new_stem:
        stem_bad = [k for k in missing + unexpected + mismatched if k.startswith(stem_prefix)]
        if stem_bad:
            fresh_prefixes[stem_prefix] = "ConvStem"

    def is_fresh(key: str) -> bool:
        return any(key.startswith(p) for p in fresh_prefixes)

    # shape mismatches first: they say most about what the checkpoint is
    shape_problems = [
        f"shape mismatch: {k} checkpoint {tuple(src[k].shape)} vs model {tuple(target[k].shape)}"
        for k in mismatched
        if not is_fresh(k)
    ]
    unexpected_problems = [
        f"unexpected in checkpoint: {k} {tuple(src[k].shape)}" for k in unexpected if not is_fresh(k)
    ]
    missing_problems = [f"missing in checkpoint: {k} {tuple(target[k].shape)}" for k in missing if not is_fresh(k)]
    problems = shape_problems + unexpected_problems + missing_problems
    if problems:
        listed = "\n  ".join(problems[:MAX_LISTED_KEYS])
        more = f"\n  ... and {len(problems) - MAX_LISTED_KEYS} more" if len(problems) > MAX_LISTED_KEYS else ""
        hint = ""
        if stem_prefix is not None and not allow_new_stem and any(stem_prefix in p for p in problems):
            hint = "\n(the stems differ; to warm-start with a fresh ConvStem pass allow_new_stem=True)"
        raise UserError(
            f"checkpoint {ckpt.path} does not match the expected architecture {_arch_name(net)!r}: "
            f"{len(shape_problems)} shape mismatches, {len(unexpected_problems)} unexpected and "
            f"{len(missing_problems)} missing keys:\n  {listed}{more}{hint}"
        )

    loaded = [k for k in target if not is_fresh(k)]
    newly_initialized = [k for k in target if is_fresh(k)]
    dropped = [k for k in src if k not in loaded]
    # strict load of a complete dict: fresh tensors are the net's own current values
    full = {k: (src[k] if k in loaded else v) for k, v in target.items()}
    net.load_state_dict(full, strict=True)

    for prefix, reason in fresh_prefixes.items():
        notes.append(f"{reason} ({prefix}*) kept at fresh initialisation")
    report = WarmStartReport(
        loaded=loaded,
        newly_initialized=newly_initialized,
        dropped=dropped,
        source=ckpt.path,
        notes=notes,
        checkpoint_normalize=ckpt.normalize,
    )
    if ckpt.normalize and not _same_normalizer(getattr(model, "normalize", None), ckpt.normalize):
        # Not an error (the caller decides), but a classic source of wrong numbers: normalising twice or never.
        report.notes.append("the checkpoint was saved with a different input normaliser than this model's")
    return report


def _same_normalizer(module: nn.Module | None, saved: dict[str, torch.Tensor]) -> bool:
    if module is None or not hasattr(module, "mean") or set(saved) != {"mean", "std"}:
        return False
    return all(
        getattr(module, name).shape == saved[name].shape
        and torch.allclose(getattr(module, name).detach().cpu().float(), saved[name].float())
        for name in ("mean", "std")
    )


def adopt_normalizer(model: RobustClassifier, saved: dict[str, torch.Tensor]) -> bool:
    """Give ``model`` the input normaliser a checkpoint was saved with (``{'mean', 'std'}``); True if it changed.

    The normaliser belongs to the weights (they were trained behind it), so a checkpoint that records one
    decides it: evaluating it behind another normaliser, or none, silently gives wrong numbers.
    """
    if set(saved) != {"mean", "std"} or _same_normalizer(model.normalize, saved):
        return False
    mean, std = (saved[name].detach().float().flatten().tolist() for name in ("mean", "std"))
    model.normalize = InputNormalization(mean, std)
    return True


def _checkpoint_num_classes(model: RobustClassifier, state_dict: dict[str, torch.Tensor]) -> int | None:
    """Size of the checkpoint's classifier, read in the net's own key names (after any layout mapping)."""
    state_dict = _adapt_foreign_layout(model.net, state_dict, find_convstem_prefix(model.net), [])
    prefix = _classifier_prefix(model.net)
    weight = state_dict.get(f"{prefix}weight") if prefix else None
    return int(weight.shape[0]) if weight is not None and weight.ndim >= 1 else None


def robustbench_weights_path(model_name: str, model_dir: str | Path, dataset: Any, threat_model: Any) -> Path:
    """Where RobustBench's load_model keeps an entry's weights (robustbench/utils.py: ``<model_dir>/<dataset>/
    <threat model>/<model_name>.pt``); a missing file is a UserError, since nothing is downloaded here.
    ``dataset`` and ``threat_model`` may be RobustBench's enums (their ``.value`` is read)."""
    dataset, threat_model = getattr(dataset, "value", dataset), getattr(threat_model, "value", threat_model)
    if (dataset, threat_model) != ("imagenet", "Linf"):
        raise UserError(
            f"RobustBench entries are known here for dataset 'imagenet', threat_model 'Linf' only "
            f"(data/robustbench_imagenet_linf.csv), not {dataset!r}, {threat_model!r}"
        )
    robustbench_entry(PREFIX + model_name)  # an unknown name: the closest entries
    path: Path = Path(model_dir) / dataset / threat_model / f"{model_name}.pt"
    if not path.is_file():
        raise UserError(
            f"{path} does not exist. RobustBench's load_model would download {model_name} there; "
            "nothing is downloaded here. Put the entry's weights file at that path, or pass "
            "custom_checkpoint=FILE (or load_model(arch, FILE))"
        )
    return path


def load_model(
    arch: str | None = None,
    checkpoint: str | Path | None = None,
    *,
    model_name: str | None = None,
    model_dir: str | Path = "./models",
    dataset: Any = "imagenet",
    threat_model: Any = "Linf",
    custom_checkpoint: str | Path = "",
    prefer_ema: bool = False,
    num_classes: int | None = None,
    image_size: int | None = None,
    mean: tuple[float, float, float] | None = None,
    std: tuple[float, float, float] | None = None,
    arch_kwargs: dict[str, Any] | None = None,
    norm: str | None = None,
) -> RobustClassifier:
    """The model of ``checkpoint`` in eval mode, taking images in [0, 1] (its normaliser inside).

    ``arch``: a timm / project architecture (``convnext_tiny_convstem``), ``robustbench:<name>`` (architecture,
    normaliser and input size of that RobustBench entry), or None for one of our Lightning checkpoints (its
    hyper-parameters name it). ``checkpoint``: our Lightning ``.ckpt``, a folder or file written by ``export``,
    the released ``weights_N.pt`` / ``weights_ema_N.pt`` / ``full_model_N.pth`` of Singh et al., a RobustBench
    file, or any state dict ``read_checkpoint`` reads. ``prefer_ema`` takes the EMA weights where the file has
    both.

    RobustBench's own call works too: ``load_model(model_name=..., model_dir="./models", dataset="imagenet",
    threat_model="Linf")``, or the entry's name first with no ``checkpoint``. It reads
    ``<model_dir>/imagenet/Linf/<model_name>.pt``, where RobustBench's load_model keeps the entry's weights
    (``custom_checkpoint``: another file). Nothing is downloaded. ``norm`` is RobustBench's deprecated name of
    ``threat_model``, which it overrides, with RobustBench's DeprecationWarning.

    The normaliser is, in order: ``mean``/``std`` given here, the one stored in the file, the RobustBench
    entry's, none. ``num_classes`` defaults to the checkpoint's head. Every tensor must match (a mismatch is a
    UserError naming the file and the expected architecture); a ViT position embedding of another grid is
    resampled to ``image_size``.
    """
    if norm is not None:
        warnings.warn("`norm` has been deprecated and will be removed in a future version.", DeprecationWarning, 2)
        threat_model = norm
    if model_name is not None or (checkpoint is None and arch is not None):
        if model_name is not None and arch is not None:
            raise UserError("give the RobustBench entry as model_name or as the first argument, not both")
        model_name = cast(str, model_name or arch).removeprefix(PREFIX)  # one of them is set (the condition)
        arch = PREFIX + model_name
        checkpoint = custom_checkpoint or robustbench_weights_path(model_name, model_dir, dataset, threat_model)
    if checkpoint is None:
        raise UserError(
            "load_model needs a checkpoint: load_model(arch, FILE), or RobustBench's "
            "load_model(model_name=..., model_dir=...)"
        )
    ckpt = read_checkpoint(checkpoint, prefer_ema=prefer_ema)
    hparams = ckpt.hyper_parameters
    if arch is None:
        if "arch" not in hparams:
            raise UserError(f"{checkpoint} does not name its architecture (not a robust-lightning .ckpt): pass arch")
        arch = hparams["arch"]
    ours = hparams.get("arch") == arch  # our Lightning checkpoint of this architecture: take its settings
    if ours:
        arch_kwargs = {**(hparams.get("arch_kwargs") or {}), **(arch_kwargs or {})}
        image_size = image_size or hparams.get("image_size")
        num_classes = num_classes or hparams.get("num_classes")
    if is_robustbench_arch(arch) and image_size is None:
        image_size = robustbench_entry(arch).preprocessing.image_size
    timm_arch, entry_mean, entry_std = resolve_arch(arch, mean, std)

    model = build_classifier(timm_arch, num_classes or 1000, image_size, entry_mean, entry_std, arch_kwargs)
    found = _checkpoint_num_classes(model, ckpt.state_dict)
    if num_classes is None and found is not None and found != 1000:
        model = build_classifier(timm_arch, found, image_size, entry_mean, entry_std, arch_kwargs)
    if ours and hparams.get("small_input"):
        use_small_input_strides(model.net)
    load_pretrained(model, ckpt, allow_new_stem=False)
    if mean is None and std is None:
        adopt_normalizer(model, ckpt.normalize)
    return model.eval()
