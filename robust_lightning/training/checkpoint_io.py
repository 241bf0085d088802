"""Checkpoints that a kill -9 can never leave half-written.

Lightning's own "atomic" save writes through an fsspec transaction, which stages the file in the system
temp directory and moves it into place: across filesystems (local /tmp, checkpoints on a shared cluster
filesystem) that move is a copy, and a job killed during it leaves a truncated last.ckpt. Here the bytes go
through ``robust_lightning.atomic`` (a temporary file beside the target, fsynced, one rename). Remote URLs
(s3://, ...) keep Lightning's behaviour.
"""

import io
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from robust_lightning.atomic import atomic_write_bytes


class AtomicCheckpointIO(TorchCheckpointIO):
    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if "://" in str(path):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options}")
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        atomic_write_bytes(path, buffer.getvalue())
