"""How images are split over the ranks: one even-split formula, the two samplers built on it, and the split of
shards (``ShardShare``).

Both samplers are torch DistributedSamplers, so Lightning keeps them: under DDP it wraps any other sampler in
a distributed one of its own. Training takes one global batch of distinct images per step however unevenly
it splits (``GlobalBatchSampler``); evaluation takes each image exactly once over all ranks, without padding
(``ExactDistributedSampler``).
"""

from collections.abc import Iterator, Sized
from typing import NamedTuple, cast

import torch
from torch.utils.data import Dataset, DistributedSampler


def rank_share(total: int, world_size: int, rank: int) -> int:
    """Rank ``rank``'s share of ``total`` images (a global batch, or an evaluation limit) split as evenly as
    possible: the first ``total % world_size`` ranks take one image more."""
    return total // world_size + (rank < total % world_size)


class ReplayIndex(int):
    """The index of an image to replay rather than load (robust_lightning.data.datasets.Replayed): the training
    sampler yields these for the steps that a resumed epoch had already trained."""


class GlobalBatchSampler(DistributedSampler[int]):
    """Training indices of this rank, one global batch of distinct images per step, however unevenly it splits.

    Every epoch draws the permutation torch's DistributedSampler draws (seed + epoch, the same on all ranks)
    and cuts it into global batches; rank r takes every world_size-th image of each, starting at the r-th:
    ``rank_share`` images per step, and the same number of steps on every rank (DDP needs it). When the
    global batch splits evenly this is torch's DistributedSampler(shuffle=True, drop_last=True) batched by
    the per-rank size, image for image. Being a DistributedSampler keeps Lightning from swapping in its own.

    In a resumed epoch the images of its first ``replay_steps`` steps come as ReplayIndex: the dataset replays
    them instead of loading them (robust_lightning.data.datasets.Replayed).
    """

    def __init__(self, dataset: Dataset[object], num_replicas: int, rank: int, global_batch: int, seed: int = 0):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.global_batch = global_batch
        self.steps = len(cast(Sized, dataset)) // global_batch
        self.replay_steps = 0  # set by the training loader when it resumes an epoch

    def __iter__(self) -> Iterator[int]:
        order = torch.randperm(
            len(cast(Sized, self.dataset)), generator=torch.Generator().manual_seed(self.seed + self.epoch)
        )
        for step in range(self.steps):
            batch = order[step * self.global_batch : (step + 1) * self.global_batch][self.rank :: self.num_replicas]
            yield from map(ReplayIndex, batch.tolist()) if step < self.replay_steps else batch.tolist()

    def __len__(self) -> int:
        return self.steps * rank_share(self.global_batch, self.num_replicas, self.rank)


class ExactDistributedSampler(DistributedSampler[int]):
    """Each index exactly once across ranks, without the padding of torch's DistributedSampler.

    Rank r takes indices r, r + world_size, ...: ``rank_share(len(cast(Sized, dataset)), world_size, r)`` of them, none
    when the dataset has fewer items than there are ranks. Neither sampler Lightning would pick does this:
    torch's DistributedSampler pads the ranks with repeated items (counted twice), and Lightning's own
    unpadded one, ``lightning.pytorch.overrides.distributed.UnrepeatedDistributedSampler`` (injected for
    predict), asserts that every rank gets at least one item, so a rank with an empty share stops the run.
    Being a DistributedSampler also keeps Lightning from swapping in its padded one.
    """

    def __init__(self, dataset: Dataset[object], num_replicas: int, rank: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, len(cast(Sized, self.dataset)), self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, len(cast(Sized, self.dataset)), self.num_replicas))


class ShardShare(NamedTuple):
    """One rank's part of a list of shards: the shards it reads, and of their samples every ``readers``-th one
    from the ``reader``-th on (all of them when ``readers`` is 1)."""

    urls: list[str]
    readers: int = 1
    reader: int = 0

    @classmethod
    def of_rank(cls, urls: list[str], world_size: int, rank: int) -> "ShardShare":
        """Whole shards when there are at least as many as ranks (every world_size-th, from the rank's); with fewer
        shards than ranks, rank r reads shard r % len(urls) together with the other ranks that share it, each
        keeping its own samples. Every sample goes to exactly one rank either way, and each rank reads at most the
        bytes of its own shards."""
        if len(urls) >= world_size:
            return cls(urls[rank::world_size])
        shard = rank % len(urls)
        return cls([urls[shard]], readers=rank_share(world_size, len(urls), shard), reader=rank // len(urls))
