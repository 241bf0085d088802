"""Reading checkpoints and warm-starting a RobustClassifier from them.

Checkpoints come in many wrappers: Lightning ``.ckpt`` (``state_dict`` with ``model.net.`` keys), timm train
checkpoints (``state_dict`` / ``state_dict_ema``), plain ``.pt``/``.pth`` state dicts (maybe ``module.``-prefixed
from DDP or ``_orig_mod.`` from torch.compile), ``.safetensors``. ``read_checkpoint`` unwraps all of them into
the key space of the timm net (``model.net``) and sets aside the input normaliser (our ``normalize.*`` buffers,
or the one a file carries in another layout).

Released robust models load as they are published:

- nmndeep/revisiting-at (Singh et al. 2023) main.py saves ``weights_N.pt`` (the DDP model:
  ``module.base_model.normalize.*`` + ``module.base_model.model.*``; without the normaliser layer
  ``module.base_model.*``), ``weights_ema_N.pt`` (the same without ``module.``) and ``full_model_N.pth``: a
  dict of state dicts (``model_state_dict``, ``state_dict_ema``, the optimiser's and the loss scaler's), not
  a pickled module. Its only non-tensor objects are numpy float64 learning rates, so it is read with
  ``weights_only=True`` plus exactly numpy's scalar and dtype reconstructors (data, no code); a file that
  pickles anything else (e.g. a whole ``nn.Module``) is refused with the way to extract its weights.
- RobustBench files (``robustbench:<name>``, see ``models.robustbench``), including those written by the
  MadryLab robustness library (``module.model.*``, a duplicate ``module.attacker.*`` dropped, the
  normaliser ``module.normalizer.new_mean/new_std``) and old-timm Swin layouts.

Nothing is unpickled beyond tensors and plain containers (``torch.load(weights_only=True)``): a checkpoint is
data, and a pickle that needs arbitrary classes is refused rather than executed.

Warm start (``load_pretrained``) is strict: every tensor of the net is either loaded with the exact shape or
explained in the report. The one expected exception is a ConvStem model warm-started from its PatchStem
counterpart (paper: non-stem layers from the clean PatchStem model, stem random), and optionally a new head.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch
from timm.layers import resample_abs_pos_embed
from timm.models.convnext import ConvNeXt
from timm.models.convnext import checkpoint_filter_fn as convnext_filter_fn
from timm.models.swin_transformer import SwinTransformer
from timm.models.swin_transformer import checkpoint_filter_fn as swin_filter_fn
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from robust_lightning.atomic import atomic_write_bytes
from robust_lightning.errors import UserError
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
    "CheckpointWeights",
    "WarmStartReport",
    "adopt_normalizer",
    "load_model",
    "load_pretrained",
    "read_checkpoint",
    "read_lightning_checkpoint",
    "read_state_dict",
    "require_checkpoint_file",
    "save_net_weights",
]

# Wrapper prefixes, stripped wherever they lead a key (repeatedly, in any order): DDP, torch.compile, the
# LightningModule attribute holding the model, our RobustClassifier's net, the WrappedModel of
# nmndeep/revisiting-at (main.py: the attack wrapper keeps the net as base_model).
WRAPPER_PREFIXES = ("module.", "_orig_mod.", "model.", "net.", "base_model.")
NORMALIZE_PREFIX = "normalize."
# MadryLab robustness library (AttackerModel): its normaliser, and the Attacker's second reference to the net
ROBUSTNESS_LIB_NORMALIZE = {"normalizer.new_mean": "mean", "normalizer.new_std": "std"}
ROBUSTNESS_LIB_ATTACKER = "attacker."
# What numpy scalars in a pickle (e.g. the float64 learning rates in an optimiser state) need to be rebuilt:
# numpy's scalar-from-bytes function and the dtypes. They construct numbers, they run no code.
NUMPY_SCALAR_GLOBALS = {"numpy.core.multiarray.scalar", "numpy._core.multiarray.scalar", "numpy.dtype"}
EMA_PREFIX = "ema.module."  # ImageClassifier keeps its timm ModelEmaV3 copy under .ema
MAX_LISTED_KEYS = 20


@dataclass
class CheckpointWeights:
    """What a checkpoint holds for the net: its tensors, and the input normaliser it was saved with (if any)."""

    state_dict: dict[str, torch.Tensor]
    normalize: dict[str, torch.Tensor]  # {'mean': (1,C,1,1), 'std': ...} or {} when the checkpoint has none
    path: str
    has_ema: bool = False  # the checkpoint also holds EMA weights (ema.module.*)
    hyper_parameters: dict = field(default_factory=dict)  # of a Lightning checkpoint or timm folder, else {}


def _strip_prefixes(key: str) -> str:
    changed = True
    while changed:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :]
                changed = True
    return key


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors, plus the normaliser that ``save_net_weights`` keeps in the metadata as ``normalize.*``."""
    try:
        tensors = safetensors.torch.load_file(str(path), device="cpu")
        with safetensors.safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise UserError(f"cannot read safetensors checkpoint {path}: {e}") from e
    for name in ("mean", "std"):
        if f"normalize_{name}" in meta and f"{NORMALIZE_PREFIX}{name}" not in tensors:
            values = [float(v) for v in meta[f"normalize_{name}"].split(",")]
            tensors[f"{NORMALIZE_PREFIX}{name}"] = torch.tensor(values).view(1, -1, 1, 1)
    return tensors


def _numpy_scalar_safe_globals() -> list:
    scalar = np._core.multiarray.scalar
    dtype_classes = sorted({type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFDG"}, key=str)
    return [
        (scalar, "numpy.core.multiarray.scalar"),
        (scalar, "numpy._core.multiarray.scalar"),
        np.dtype,
        *dtype_classes,
    ]


def _load_file(path: Path) -> object:
    if path.suffix == ".safetensors":
        return _load_safetensors(path)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        unsafe = _unsafe_globals(path)
        if unsafe and set(unsafe) <= NUMPY_SCALAR_GLOBALS:
            # e.g. revisiting-at's full_model_N.pth: float64 learning rates in the optimiser state
            with torch.serialization.safe_globals(_numpy_scalar_safe_globals()):
                return torch.load(path, map_location="cpu", weights_only=True)
        if unsafe:
            raise UserError(
                f"refusing to load {path}: it pickles Python objects ({', '.join(unsafe[:5])}), and checkpoints "
                "are loaded with torch.load(weights_only=True) so that unpickling cannot run arbitrary code. "
                "Expected a state dict of tensors (.pt/.pth/.ckpt) or a .safetensors file. If you trust the "
                "file, extract its weights once in Python: obj = torch.load(PATH, weights_only=False); "
                "torch.save(obj.state_dict() if hasattr(obj, 'state_dict') else obj['model_state_dict'], "
                "'weights.pt'); then load weights.pt."
            ) from e
        raise UserError(
            f"cannot read checkpoint {path}: expected a PyTorch state dict (.pt/.pth/.ckpt) or a .safetensors "
            "file (torch.load(weights_only=True) failed; arbitrary pickles are refused)"
        ) from e
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError) as e:
        raise UserError(
            f"cannot read checkpoint {path}: expected a PyTorch state dict (.pt/.pth/.ckpt) or a .safetensors "
            f"file ({type(e).__name__}: {_reason(e)})"
        ) from e


def _reason(e: Exception) -> str:
    """The first sentence of an exception's message (torch appends paragraphs of advice to its zip errors)."""
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text.split(". ")[0].rstrip(".")


def _unsafe_globals(path: Path) -> list[str]:
    """Names of the classes/functions a torch.save file would need to unpickle ([] if unknown)."""
    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception:  # not a zip checkpoint (legacy or garbage): cannot tell
        return []


def _pick_state_dict(obj: object, path: Path, prefer_ema: bool) -> dict[str, torch.Tensor]:
    if not isinstance(obj, dict):
        raise UserError(f"checkpoint {path} holds a {type(obj).__name__}; expected a dict of tensors")
    if prefer_ema and isinstance(obj.get("state_dict_ema"), dict):
        return obj["state_dict_ema"]
    # Lightning and timm train checkpoints; DeiT/ConvNeXt releases; revisiting-at's full_model_N.pth
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj.get(key), dict):
            return obj[key]
    if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    raise UserError(
        f"checkpoint {path} has no state dict: expected a dict of tensors or one under 'state_dict' or 'model' "
        f"(top-level keys: {', '.join(map(str, list(obj)[:10]))})"
    )


TIMM_FOLDER_CONFIG, TIMM_FOLDER_WEIGHTS = "config.json", "model.safetensors"
CHECKPOINT_KINDS = (
    "a checkpoint file (.ckpt, .pt/.pth or .safetensors) or a timm model folder (config.json and "
    "model.safetensors, as export writes)"
)


def require_weights(path: str | Path) -> None:
    """:func:`require_checkpoint_file`, where a timm model folder (what ``export`` writes) is accepted too."""
    if not (Path(path) / TIMM_FOLDER_CONFIG).is_file():
        require_checkpoint_file(path)


def require_checkpoint_file(path: str | Path, expected: str = CHECKPOINT_KINDS) -> None:
    """A UserError naming ``path`` and what was expected when it is missing, a directory or empty."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path} is a directory; expected {expected}")
    if not path.is_file():
        raise UserError(f"checkpoint not found: {path}; expected {expected}")
    if path.stat().st_size == 0:
        raise UserError(f"checkpoint {path} is empty (0 bytes); expected {expected}")


def read_lightning_checkpoint(path: str | Path) -> dict:
    """The hyper-parameters of a Lightning checkpoint (``--ckpt_path``), checked before Lightning reads it.

    The file is memory-mapped (``torch.load(mmap=True, weights_only=True)``), so the check reads the
    metadata without copying the weights. Missing, empty, truncated files and weight files that are not a
    training checkpoint (no ``state_dict``) are a UserError naming the path and what was expected.
    """
    path = Path(path)
    expected = "a .ckpt file written by robust-lightning fit"
    require_checkpoint_file(path, expected)
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise UserError(
            f"refusing to load {path}: it pickles Python objects (checkpoints load with "
            f"torch.load(weights_only=True)); expected {expected}"
        ) from e
    except (RuntimeError, EOFError, zipfile.BadZipFile, OSError, ValueError) as e:
        raise UserError(
            f"cannot read checkpoint {path} (truncated or not a PyTorch checkpoint: {_reason(e)}); expected {expected}"
        ) from e
    if not isinstance(loaded, dict) or not isinstance(loaded.get("state_dict"), dict):
        raise UserError(
            f"{path} is not a Lightning training checkpoint (no 'state_dict'); expected {expected}. "
            "To evaluate a weights file (.pt/.pth/.safetensors, a released model), pass it as "
            "--model.init_from instead of --ckpt_path"
        )
    hparams = loaded.get("hyper_parameters")
    return dict(hparams) if isinstance(hparams, dict) else {}


def read_checkpoint(path: str | Path, prefer_ema: bool = False) -> CheckpointWeights:
    """Read a checkpoint into the net's key space; ``normalize.*`` buffers are returned separately.

    ``prefer_ema`` picks the EMA weights: ``ema.module.*`` of this project's checkpoints, ``state_dict_ema`` of
    timm train checkpoints. (Lightning checkpoints written with EMAWeightAveraging already hold the EMA weights
    under ``state_dict``.) Without it, EMA weights are left out.
    """
    path = Path(path)
    if (path / TIMM_FOLDER_CONFIG).is_file():
        return read_timm_folder(path)
    require_checkpoint_file(path)
    loaded = _load_file(path)
    raw = _pick_state_dict(loaded, path, prefer_ema)
    if isinstance(loaded, dict) and raw is not loaded:  # a normaliser kept beside the state dict (.pt exports)
        raw = {**{k: v for k, v in loaded.items() if k.startswith(NORMALIZE_PREFIX)}, **raw}
    # Our Lightning checkpoints keep the EMA copy beside the raw weights, under ema.module.*
    ema = {k[len(EMA_PREFIX) :]: v for k, v in raw.items() if k.startswith(EMA_PREFIX)}
    raw = ema if prefer_ema and ema else {k: v for k, v in raw.items() if not k.startswith(EMA_PREFIX)}
    state_dict: dict[str, torch.Tensor] = {}
    normalize: dict[str, torch.Tensor] = {}
    for key, value in raw.items():
        if not isinstance(value, torch.Tensor):
            continue  # e.g. Lightning may keep non-tensor extra state; not weights
        key = _strip_prefixes(key)
        if key.startswith(NORMALIZE_PREFIX):
            normalize[key[len(NORMALIZE_PREFIX) :]] = value
        elif key in ROBUSTNESS_LIB_NORMALIZE:
            normalize[ROBUSTNESS_LIB_NORMALIZE[key]] = value.reshape(1, -1, 1, 1)
        elif not key.startswith(ROBUSTNESS_LIB_ATTACKER):
            state_dict[key] = value
    if not state_dict:
        raise UserError(f"checkpoint {path} contains no weight tensors")
    hparams = loaded.get("hyper_parameters") if isinstance(loaded, dict) else None
    return CheckpointWeights(
        state_dict=state_dict,
        normalize=normalize,
        path=str(path),
        has_ema=bool(ema),
        hyper_parameters=hparams if isinstance(hparams, dict) else {},
    )


def read_timm_folder(path: Path) -> CheckpointWeights:
    """A timm model folder (written by ``robust-lightning export`` or timm's ``save_for_hf``): the weights of its
    model.safetensors; from its config.json the architecture, the classes, the resolution and the normaliser
    (``pretrained_cfg`` mean/std; 0 and 1, written for models that take raw [0, 1] images, mean none)."""
    try:
        config = json.loads((path / TIMM_FOLDER_CONFIG).read_text())
        architecture, pretrained = config["architecture"], config.get("pretrained_cfg", {})
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise UserError(f"{path / TIMM_FOLDER_CONFIG} is not a timm model config (no 'architecture'): {e}") from None
    weights = path / TIMM_FOLDER_WEIGHTS
    if not weights.is_file():
        raise UserError(
            f"the timm model folder {path} has no {TIMM_FOLDER_WEIGHTS}; expected the folder "
            "`robust-lightning export CKPT FOLDER` writes"
        )
    read = read_checkpoint(weights)
    mean, std = pretrained.get("mean"), pretrained.get("std")
    normalize = {}
    if mean and std and not (all(m == 0 for m in mean) and all(s == 1 for s in std)):
        normalize = {"mean": torch.tensor(mean).view(1, -1, 1, 1), "std": torch.tensor(std).view(1, -1, 1, 1)}
    hyper_parameters = {
        "arch": architecture,
        "num_classes": config.get("num_classes"),
        "image_size": (pretrained.get("input_size") or [None])[-1],
    }
    hyper_parameters = {key: value for key, value in hyper_parameters.items() if value is not None}
    return CheckpointWeights(
        state_dict=read.state_dict,
        normalize=normalize,
        path=str(path),
        has_ema=False,
        hyper_parameters=hyper_parameters,
    )


def read_state_dict(path: str | Path, prefer_ema: bool = False) -> dict[str, torch.Tensor]:
    """The net's tensors from any supported checkpoint (see ``read_checkpoint``; normaliser dropped)."""
    return read_checkpoint(path, prefer_ema=prefer_ema).state_dict


def save_net_weights(model: nn.Module, path: str | Path) -> Path:
    """Write the timm net's state dict (no ``net.`` prefix, no normaliser) as .safetensors or .pt/.pth.

    Such a file loads with ``read_state_dict`` and also with timm itself:
    ``timm.create_model(arch, pretrained=True, pretrained_cfg_overlay=dict(file=path))``. The normaliser (if
    any) stays out of the net's tensors, since timm's strict loading would reject extra keys: it goes into the
    safetensors metadata, or beside the state dict of a .pt/.pth file (``{"state_dict": ..., "normalize.mean":
    ..., "normalize.std": ...}``, where timm's ``load_state_dict`` reads ``state_dict``).
    """
    path = Path(path)
    net = getattr(model, "net", model)
    state = {k: v.detach().cpu().contiguous() for k, v in net.state_dict().items()}
    norm = getattr(model, "normalize", None)
    if path.suffix == ".safetensors":
        meta = {"format": "pt"}
        if norm is not None and hasattr(norm, "mean"):
            meta["normalize_mean"] = ",".join(f"{v:.8g}" for v in norm.mean.flatten().tolist())
            meta["normalize_std"] = ",".join(f"{v:.8g}" for v in norm.std.flatten().tolist())
        # shared storage (e.g. tied weights) is not allowed in safetensors: clone each tensor
        data = safetensors.torch.save({k: v.clone() for k, v in state.items()}, metadata=meta)
    else:
        buffer = io.BytesIO()
        if norm is not None and hasattr(norm, "mean"):
            state = {
                "state_dict": state,
                **{f"{NORMALIZE_PREFIX}{name}": buffer_.detach().cpu() for name, buffer_ in norm.named_buffers()},
            }
        torch.save(state, buffer)
        data = buffer.getvalue()
    # atomic: a full disk or a kill never leaves a half-written weights file, and the file gets the umask's mode
    atomic_write_bytes(path, data)
    return path


# ---------------------------------------------------------------------------------------------------------
# warm start


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
        sd = convnext_filter_fn(sd, net)  # facebookresearch/ConvNeXt names -> timm
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
    target = net.pos_embed
    grid = getattr(getattr(net, "patch_embed", None), "grid_size", None)
    if src.ndim != 3 or target.ndim != 3 or src.shape[-1] != target.shape[-1] or grid is None:
        return src  # not resamplable; reported as a shape mismatch
    num_prefix = 0 if getattr(net, "no_embed_class", False) else getattr(net, "num_prefix_tokens", 1)
    side = math.isqrt(src.shape[1] - num_prefix)
    if side * side != src.shape[1] - num_prefix:
        return src
    out = resample_abs_pos_embed(src, new_size=list(grid), old_size=[side, side], num_prefix_tokens=num_prefix)
    notes.append(f"pos_embed resampled from a {side}x{side} to a {grid[0]}x{grid[1]} grid")
    return out


def _classifier_prefix(net: nn.Module) -> str | None:
    if not hasattr(net, "get_classifier"):
        return None
    head = net.get_classifier()
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
    path = Path(model_dir) / dataset / threat_model / f"{model_name}.pt"
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
    arch_kwargs: dict | None = None,
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
    (``custom_checkpoint``: another file). Nothing is downloaded.

    The normaliser is, in order: ``mean``/``std`` given here, the one stored in the file, the RobustBench
    entry's, none. ``num_classes`` defaults to the checkpoint's head. Every tensor must match (a mismatch is a
    UserError naming the file and the expected architecture); a ViT position embedding of another grid is
    resampled to ``image_size``.
    """
    if model_name is not None or (checkpoint is None and arch is not None):
        if model_name is not None and arch is not None:
            raise UserError("give the RobustBench entry as model_name or as the first argument, not both")
        model_name = (model_name or arch).removeprefix(PREFIX)
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
