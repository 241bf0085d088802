"""The images of one optimiser step: the global batch over all ranks, each rank's share, and the micro-batches a
share is split into. The data module owns the one ``GlobalBatch`` of a run and places it on the ranks in setup;
the model and the throughput monitor read it (``global_batch_of``) instead of deriving it again.
"""

import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import lightning.pytorch as pl

from robust_lightning.data.samplers import rank_share
from robust_lightning.errors import UserError


@dataclass
class GlobalBatch:
    """The training images of one optimiser step (the paper's recipes fix them over all devices).

    ``configured`` is data.global_batch_size, split over the ranks as evenly as possible (the first
    ``configured % world_size`` ranks take one image more); without it every rank takes ``per_device``
    (data.batch_size). A share larger than ``max_device_batch`` (data.max_device_batch_size) is split into
    micro-batches whose gradients are accumulated, so that every step still sees exactly the global batch.
    """

    configured: int | None
    per_device: int
    max_device_batch: int | None = None
    world_size: int = 1
    rank: int = 0
    micro_batches: int = field(default=1, init=False)  # forward passes per step on each rank (set by place)

    def __post_init__(self) -> None:
        if self.max_device_batch is not None and self.max_device_batch < 1:
            raise UserError(
                f"data.max_device_batch_size must be a positive number of images, got {self.max_device_batch}"
            )

    @property
    def images(self) -> int:
        """Training images per optimiser step over all ranks."""
        return self.configured or self.per_device * self.world_size

    @property
    def share(self) -> int:
        """This rank's images per optimiser step."""
        return rank_share(self.configured, self.world_size, self.rank) if self.configured else self.per_device

    @property
    def fixed(self) -> bool:
        """Whether the step's images are set here (a global size or a micro-batch cap), so that the trainer's own
        gradient accumulation would multiply them."""
        return bool(self.configured or self.max_device_batch)

    def place(self, world_size: int, rank: int) -> None:
        """Split the global batch over ``world_size`` ranks, as rank ``rank`` sees it."""
        if self.configured and self.configured < world_size:
            raise UserError(
                f"data.global_batch_size {self.configured} leaves some of the {world_size} devices "
                "without an image; use a global batch of at least one image per device"
            )
        self.world_size, self.rank = world_size, rank
        self.micro_batches = self._micro_batches()

    def _micro_batches(self) -> int:
        """The fewest forward passes that keep every rank's micro-batches within max_device_batch (ranks' shares
        differ by at most one image; all ranks take as many passes)."""
        if self.max_device_batch is None:
            return 1
        shares = [rank_share(self.images, self.world_size, r) for r in range(self.world_size)]
        passes = math.ceil(max(shares) / self.max_device_batch)
        if min(shares) < passes:
            raise UserError(
                f"data.max_device_batch_size {self.max_device_batch} splits the smallest share of "
                f"the global batch ({min(shares)} images) into {passes} micro-batches, some empty; "
                "use a larger data.max_device_batch_size"
            )
        return passes

    def accumulate_in(self, trainer: pl.Trainer) -> None:
        """Make ``trainer`` accumulate the gradients of a step's micro-batches: Lightning's loop reads its
        accumulate_grad_batches, while the model reads ``micro_batches`` here. The trainer's own setting would
        multiply a global batch fixed here, so it is refused then; without a fixed global batch it would be replaced
        by ``micro_batches`` without a word, so it is refused too, naming the options that do the same."""
        accumulate = getattr(trainer, "accumulate_grad_batches", 1)
        if self.fixed and accumulate not in (1, self.micro_batches):
            raise UserError(
                f"trainer.accumulate_grad_batches {accumulate} would multiply data.global_batch_size: "
                "every optimiser step already sees exactly the global batch; to fit it into less "
                "memory, set data.max_device_batch_size (images per forward pass on one device) instead"
            )
        if not self.fixed and accumulate not in (1, self.micro_batches):
            raise UserError(
                f"trainer.accumulate_grad_batches {accumulate} is not how this project accumulates: set "
                "data.global_batch_size (images per optimiser step, over all devices) and "
                "data.max_device_batch_size (images per forward pass on one device) instead"
            )
        trainer.accumulate_grad_batches = self.micro_batches


@runtime_checkable
class HasGlobalBatch(Protocol):
    """A data module that fixes the images of an optimiser step (ImageNetDataModule)."""

    global_batch: GlobalBatch


def global_batch_of(trainer: pl.Trainer) -> GlobalBatch | None:
    """The global batch of ``trainer``'s data module, or None for a data module that does not set one."""
    datamodule = getattr(trainer, "datamodule", None)
    return datamodule.global_batch if isinstance(datamodule, HasGlobalBatch) else None
