"""What code may do with a tensor's values without waiting for its device: shared by the attacks, the batched
augmentation and the training step, which each keep a path for the CPU and one for GPUs."""

from torch import Tensor


def host_reads_are_cheap(t: Tensor) -> bool:
    """Whether code may branch on ``t``'s values: on the CPU reading them costs nothing, on a GPU it waits for
    the device's queue to drain. The one switch between the two paths (a test forces the device path on the CPU
    to check that it never reads back)."""
    return t.device.type == "cpu"
