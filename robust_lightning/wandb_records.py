"""What a W&B run's local record file holds: the ``run-<id>.wandb`` file that every run writes, offline or online,
into its folder (``<dir>/wandb/offline-run-<time>-<id>/`` or ``run-<time>-<id>/``).

wandb 0.19 and later ship no Python reader of these files. Their format is LevelDB's log format with W&B's header
(``:W&B``, the magic number 0xBEE1, a version byte): 32 KiB blocks of chunks, each with a 7-byte header (CRC32,
length, type: 1 full, 2 first, 3 middle, 4 last; a block's tail shorter than a header is padding), the chunks of
a record making one protobuf ``wandb.proto.wandb_internal_pb2.Record``. A file whose writer was killed ends in a
record cut short; the records before it are read.

A fit's later attempts read the files of the earlier ones (``robust_lightning.loggers.WandbLogger``): the history
``_step`` they reached, to continue it, and the rows they hold, to send those they lack.
"""

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HEADER = struct.Struct("<4sHB")  # ":W&B", 0xBEE1, version
CHUNK = struct.Struct("<IHB")  # CRC32, length, type
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path: Path) -> list[Any]:
    """The whole records of a ``run-*.wandb`` file, as ``wandb_internal_pb2.Record`` messages."""
    from wandb.proto import wandb_internal_pb2  # noqa: PLC0415 (wandb loads only where a run is read)

    data = path.read_bytes()
    if len(data) < HEADER.size or HEADER.unpack(data[: HEADER.size])[:2] != (b":W&B", 0xBEE1):
        raise ValueError(f"{path} is not a W&B record file")
    records = []
    for payload in _payloads(data):
        record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated code without stubs
        try:
            record.ParseFromString(payload)
        except Exception:  # noqa: BLE001 (protobuf's DecodeError: a record cut short ends the file)
            break
        records.append(record)
    return records


def _payloads(data: bytes) -> Iterator[bytes]:
    chunks: list[bytes] = []
    position = HEADER.size
    while position + CHUNK.size <= len(data):
        left = BLOCK - position % BLOCK
        _, length, kind = CHUNK.unpack(data[position : position + CHUNK.size])
        if left < CHUNK.size or kind == 0:  # padding to the end of the block
            position += left
            continue
        end = position + CHUNK.size + length
        if end > len(data):  # cut short by a kill
            return
        chunks.append(data[position + CHUNK.size : end])
        position = end
        if kind in (FULL, LAST):
            yield b"".join(chunks)
            chunks = []


def history_rows(records: list[Any]) -> list[dict[str, Any]]:
    """The history rows of a run's records, each a dict of its keys (``_step`` included) and their values; a
    media value (a table, an image) comes as one item per field and is nested as W&B nests it."""
    rows = []
    for record in records:
        if record.WhichOneof("record_type") != "history":
            continue
        row: dict[str, Any] = {}
        for item in record.history.item:
            *parents, leaf = list(item.nested_key) or [item.key]
            node = row
            for key in parents:
                node = node.setdefault(key, {})
            node[leaf] = json.loads(item.value_json)
        rows.append(row)
    return rows


def run_record_files(wandb_dir: Path, run_id: str) -> list[Path]:
    """The record files of the run ``run_id`` under ``wandb_dir`` (a W&B ``dir``'s ``wandb`` folder), one per
    attempt that logged to it, oldest first (their folders are named by their start time)."""
    folders = sorted(
        (folder for folder in wandb_dir.glob(f"*-{run_id}") if folder.is_dir()),
        key=lambda folder: folder.name.split("-")[-2] if folder.name.count("-") >= 2 else folder.name,
    )
    return [folder / f"run-{run_id}.wandb" for folder in folders if (folder / f"run-{run_id}.wandb").is_file()]
