"""The process's random number generators as checkpoint data, so a resumed fit draws what the uninterrupted one
would have drawn: augmentation (torch, and NumPy for timm's MixUp/CutMix), the attack's draws, and Python's
``random``. Lightning does not save them. Stored as tensors, lists and ints only, so checkpoints still load with
torch.load(weights_only=True)."""

import random
from typing import NotRequired, TypedDict, cast

import numpy as np
import numpy.typing as npt
import torch


class NumpyState(TypedDict):
    """NumPy's global state (its legacy tuple), with the key as a tensor."""

    kind: str
    keys: torch.Tensor
    position: int
    has_gauss: int
    cached_gaussian: float


class RandomStates(TypedDict):
    """The states ``random_states`` saves: torch's (CPU, and CUDA where this process uses it), NumPy's and Python's
    ``random`` (its ``getstate()`` tuple in three parts)."""

    torch: torch.Tensor
    numpy: NumpyState
    python: list[int]
    python_version: int
    python_gauss: float | None
    cuda: NotRequired[torch.Tensor]


def random_states() -> RandomStates:
    """The current states of torch (CPU, and this process's CUDA device), NumPy and Python ``random``."""
    # the legacy tuple (get_state's default; its dict form only with legacy=False)
    kind, keys, position, has_gauss, cached_gaussian = cast(
        tuple[str, npt.NDArray[np.uint32], int, int, float], np.random.get_state()
    )
    states: RandomStates = {
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
    # is_initialized: unannotated in torch
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_random_states(states: RandomStates) -> None:
    """Restore what ``random_states`` saved (the CUDA state only where this process uses CUDA)."""
    torch.set_rng_state(states["torch"].cpu())
    n = states["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["position"], n["has_gauss"], n["cached_gaussian"])
    )
    random.setstate((states["python_version"], tuple(states["python"]), states["python_gauss"]))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"].cpu())
