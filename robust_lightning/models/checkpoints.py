"""Reading and writing checkpoints: every wrapper unwrapped into the key space of the timm net.

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
"""

from __future__ import annotations

import io
import json
import pickle
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import safetensors
import safetensors.torch
import torch
from torch import nn

from robust_lightning.atomic import atomic_write_bytes
from robust_lightning.errors import UserError

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


@dataclass
class CheckpointWeights:
    """What a checkpoint holds for the net: its tensors, and the input normaliser it was saved with (if any)."""

    state_dict: dict[str, torch.Tensor]
    normalize: dict[str, torch.Tensor]  # {'mean': (1,C,1,1), 'std': ...} or {} when the checkpoint has none
    path: str
    has_ema: bool = False  # the checkpoint also holds EMA weights (ema.module.*)
    hyper_parameters: dict[str, Any] = field(default_factory=dict)  # of a Lightning checkpoint or timm folder, else {}


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


def _numpy_scalar_safe_globals() -> list[Callable[..., object] | tuple[Callable[..., object], str]]:
    scalar = np._core.multiarray.scalar  # type: ignore[attr-defined]  # numpy 2's private module: not in its stubs
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
        ema: dict[str, torch.Tensor] = obj["state_dict_ema"]
        return ema
    # Lightning and timm train checkpoints; DeiT/ConvNeXt releases; revisiting-at's full_model_N.pth
    for key in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj.get(key), dict):
            found: dict[str, torch.Tensor] = obj[key]
            return found
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


def read_lightning_checkpoint(path: str | Path) -> dict[str, Any]:
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
