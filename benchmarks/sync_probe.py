"""Host-device synchronisations recorded where they happen, for benchmarks/gpu_suite.py.

On a GPU, every value read back to the host (``.item()``, ``.tolist()``, a boolean mask's indexing, a copy to or
from pageable host memory) makes the host wait until the device's queue has drained. CUDA's sync debug mode flags
each one; here each flag is recorded with the line of the project's code that caused it, instead of raising at the
first (``torch.cuda.set_sync_debug_mode("error")``), so that one run lists them all. On the CPU nothing is recorded:
the tests check the same code paths there op by op (tests/helpers.py, ``HostReads``).
"""

import contextlib
import json
import traceback
import warnings
from pathlib import Path

import torch
from lightning import Callback


def place_in_code() -> str:
    """The innermost frame of the project's code (else Lightning's, else any) on the stack: 'file:line in name'."""
    frames = traceback.extract_stack()[:-2]
    for package in ("robust_lightning", "lightning"):
        inside = [frame for frame in frames if f"/{package}/" in frame.filename]
        if inside:
            frame = inside[-1]
            return f"{package}/{frame.filename.split(f'/{package}/')[-1]}:{frame.lineno} in {frame.name}"
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} in {frame.name}"


@contextlib.contextmanager
def synchronisations(device: torch.device):
    """Yields a list that receives the place of every host-device synchronisation made inside the block."""
    places: list[str] = []
    if device.type != "cuda":
        yield places
        return
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        show = warnings.showwarning

        def note(message, category, filename, lineno, file=None, line=None):
            if "synchronizing CUDA operation" in str(message):
                places.append(place_in_code())
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield places
        finally:
            torch.cuda.set_sync_debug_mode("default")


class SyncProbe(Callback):
    """Records the synchronisations of a fit's second optimiser step into the JSON file ``record``: the loading
    and transfer of its batches, the augmentation, every micro-batch's attack, forward and backward, the optimiser
    step, the EMA update and every hook in between. The second step is not a logging step as long as
    ``trainer.log_every_n_steps`` is more than 2 (the Throughput callback synchronises at logging steps, by
    design); with 2 or less the probe says so in the record."""

    def __init__(self, record: str):
        self.record = Path(record)
        self._block = self._places = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._block is None and trainer.global_step == 1:  # the first optimiser step has just ended
            self._block = synchronisations(pl_module.device)
            self._places = self._block.__enter__()
        elif self._places is not None and trainer.global_step == 2:
            self._block.__exit__(None, None, None)
            record = {
                "device": str(pl_module.device),
                "optimiser_step": 2,
                "logging_step": 2 % max(1, trainer.log_every_n_steps) == 0,
                "synchronisations": self._places,
            }
            self.record.write_text(json.dumps(record, indent=1))
            self._places = None
