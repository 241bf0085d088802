"""The process's random number generators as checkpoint data, so a resumed fit draws what the uninterrupted one
would have drawn: augmentation (torch, and NumPy for timm's MixUp/CutMix), the attack's draws, and Python's
``random``. Lightning does not save them. Stored as tensors, lists and ints only, so checkpoints still load with
torch.load(weights_only=True)."""

import random
from typing import cast

import numpy as np
import torch


def random_states() -> dict:
    """The current states of torch (CPU, and this process's CUDA device), NumPy and Python ``random``."""
    # the legacy tuple (get_state's default; its dict form only with legacy=False)
    kind, keys, position, has_gauss, cached_gaussian = cast(
        tuple[str, np.ndarray, int, int, float], np.random.get_state()
    )
    states = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": list(random.getstate()[1]),
        "python_version": random.getstate()[0],
        "python_gauss": random.getstate()[2],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_random_states(states: dict) -> None:
    """Restore what ``random_states`` saved (the CUDA state only where this process uses CUDA)."""
    torch.set_rng_state(states["torch"].cpu())
    n = states["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["position"], n["has_gauss"], n["cached_gaussian"])
    )
    random.setstate((states["python_version"], tuple(states["python"]), states["python_gauss"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"].cpu())
