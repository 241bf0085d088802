"""A whole heavy-augmentation APGD-AT training step through the command line (the device-side crop, RandAugment,
erasing and MixUp/CutMix, the attack, the update, gradient accumulation, the EMA, Lightning's logging and the
progress display) reads nothing back from the device outside logging steps: on a GPU each read would make the host
wait for the device's queue. The GPU code paths are forced on the CPU (helpers.force_device_path).

A copy from the host to the device waits as well, and the CPU cannot show one: every tensor is already where it is
used. So the probe also records each value logged as a Python number, which Lightning copies to the device (on an
H200 the GPU suite found two such values logged in every micro-batch, benchmarks/RESULTS.md)."""

import numbers
from typing import ClassVar

import pytest
from lightning import Callback

from helpers import HostReads, force_device_path, tiny_config
from robust_lightning.cli import main

PROBED_STEP = 2  # the second optimiser step: not a logging step, as log_every_n_steps is 4


class ProbeStep(Callback):
    """Records from the end of the optimiser step before PROBED_STEP to the end of PROBED_STEP, all its
    micro-batches: their loading, transfer and augmentation, training steps and backward passes, the optimiser
    step, the EMA and every hook. ``calls`` gets the reads, ``logged_numbers`` the names logged as Python
    numbers."""

    calls: ClassVar[list] = []
    logged_numbers: ClassVar[list] = []

    def __init__(self):
        self.mode = None
        self.done = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.done:
            return
        if self.mode is None and trainer.global_step == PROBED_STEP - 1:
            self.mode = HostReads()
            self.mode.__enter__()
            log = pl_module.log

            def recording_log(name, value, *args, **kwargs):
                if isinstance(value, numbers.Number):
                    ProbeStep.logged_numbers.append(name)
                return log(name, value, *args, **kwargs)

            pl_module.log = recording_log  # an instance attribute: callbacks' pl_module.log calls come here too
        elif self.mode is not None and trainer.global_step == PROBED_STEP:
            self.mode.__exit__(None, None, None)
            del pl_module.log
            ProbeStep.calls = self.mode.calls
            self.done = True


def device_reads(calls: list[tuple[str, str]]) -> list[tuple[str, str]]:
    # torch.optim keeps AdamW's step counter on the host (neither capturable nor fused): reading it waits for
    # nothing on a GPU, but the CPU test cannot tell it from a device tensor
    return [(op, where) for op, where in calls if "torch/optim/optimizer.py" not in where]


@pytest.mark.parametrize(
    "arch, display, max_device_batch_size, reuse",
    [
        ("test_resnet", "robust_lightning.training.progress.ProgressLines", None, None),
        ("test_resnet", "robust_lightning.training.progress.StepProgressBar", 3, None),
        ("test_convnext", "robust_lightning.training.progress.StepProgressBar", None, None),
        ("test_convnext", "robust_lightning.training.progress.ProgressLines", None, True),
    ],
)
def test_a_training_step_reads_nothing_back_outside_logging_steps(
    tmp_path, monkeypatch, arch, display, max_device_batch_size, reuse
):
    force_device_path(monkeypatch)
    ProbeStep.calls, ProbeStep.logged_numbers = [], []
    config = tiny_config(
        tmp_path,
        **{
            "trainer.max_steps": 3,
            "trainer.log_every_n_steps": 4,
            # more batches than tiny_config's 3: the probed step then ends mid-epoch, and with accumulation its
            # second micro-batch is the epoch's fourth batch, which a display counting batches would read after
            "trainer.limit_train_batches": 8,
            "trainer.enable_progress_bar": True,
            # the probe after the display: its window then ends after the display's hook of the step's last batch
            "trainer.callbacks": [{"class_path": display}, {"class_path": "test_step_host_reads.ProbeStep"}],
            "data.augmentation": "heavy",
            "data.batch_size": 6,
            "data.max_device_batch_size": max_device_batch_size,
            "model.arch": arch,
            "model.attack": "apgd",
            "model.ema_decay": 0.9,
            "model.reuse_attack_forward": reuse,
        },
    )
    assert main(["fit", "--config", str(config)]) == 0
    reads = device_reads(ProbeStep.calls)
    assert ProbeStep.calls, "the probe recorded nothing"
    assert ProbeStep.logged_numbers == [], "logged as numbers (each a copy to the device)"
    if reuse:  # forced (off the CPU the default does not reuse): the attack's last forward is the update's
        # the one read it keeps: how many points need a forward of their own because their highest-loss iterate is
        # not the last (a fixed shape would re-run the whole batch, an eighth of the step)
        assert [op for op, _ in reads] == ["aten.nonzero.default"], HostReads.listing(ProbeStep())
        assert "_with_best_iterates" in reads[0][1]
    else:
        assert reads == [], "\n".join(f"{op}\n{where}" for op, where in reads)
