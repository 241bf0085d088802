"""The resumable per-image outcome store of AutoAttackEvaluation and ResolutionSweep.

A directory per evaluated setting (a threat model, a resolution's cell) holds ``manifest.json`` (what the
outcomes were computed with: a re-run with anything else is refused while the folder holds an image's outcome,
and takes over a folder that holds none) and ``rank<r>.jsonl``: one JSON line per batch and rank, {"key",
"label", "clean", "robust", "broken_by", "seconds"} with one entry per image, appended and fsynced before the
next batch. A re-run skips the keys that already have an outcome, so an interrupted evaluation resumes without
redoing or double-counting images; a line cut short by a kill is ignored (its batch is redone). Reading merges
every rank and session, each key once.
"""

import json
import os
from collections.abc import Callable, Sized
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_info

from robust_lightning.atomic import atomic_write_json
from robust_lightning.errors import UserError
from robust_lightning.locking import LOCK_NAME, exclusive


def read_outcomes(directory: Path) -> dict[str, dict[str, Any]]:
    """Per-image outcomes saved in ``directory`` (all ranks, all sessions): key -> record; first record wins."""
    outcomes: dict[str, dict[str, Any]] = {}
    for path in sorted(directory.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                batch = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill: its batch is simply redone
                continue
            for i, key in enumerate(batch["key"]):
                outcome = {
                    "label": batch["label"][i],
                    "clean": batch["clean"][i],
                    "robust": batch["robust"][i],
                    "broken_by": batch["broken_by"][i],
                }
                if "adaptive" in batch:  # AutoAttack's adaptive attacks, where the checks called for them
                    outcome["adaptive"] = {name: values[i] for name, values in batch["adaptive"].items()}
                    outcome["reported"] = batch["reported"][i]
                outcomes.setdefault(key, outcome)
    return outcomes


def append_record(path: Path, record: dict[str, Any]) -> None:
    """Append one batch's outcomes as a JSON line, on disk (fsynced) before the next batch starts."""
    with open(path, "a+b") as f:  # appends go to the end whatever the read position
        if f.seek(0, os.SEEK_END):
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":  # a line a kill cut short: ours must not be glued onto it
                f.write(b"\n")
        f.write((json.dumps(record) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())


def in_todays_keys(saved: dict[str, Any], identity: dict[str, Any]) -> dict[str, Any]:
    """A manifest written before the identities recorded every source's location, in today's keys, so that its
    outcomes still resume: AutoAttack recorded a folder's root as ``data_root`` and the val shards as
    ``data_val_shards`` and other sources' location not at all, the resolution sweep neither the source nor its
    location; what was not recorded matched any location then, and is taken to be this one."""
    if "data_location" in saved or "data_location" not in identity:
        return saved
    saved = dict(saved)
    root, shards = saved.pop("data_root", None), saved.pop("data_val_shards", None)
    saved["data_location"] = root or shards or identity["data_location"]
    saved.setdefault("data_source", identity["data_source"])
    return saved


def claim_directory(
    directory: Path,
    identity: dict[str, Any],
    is_global_zero: bool,
    owner: str,
    locks: ExitStack | None = None,
    saved_records: Callable[[Path], Sized] = read_outcomes,
) -> None:
    """Refuse to mix outcomes of another checkpoint or setting into ``directory``; record ours (replacing the
    manifest of another evaluation that saved no image's outcome there).
    ``owner``: the callback whose ``results_dir`` the error message tells the user to change. ``locks``: where
    global rank zero keeps the directory's lock until the caller closes it when its evaluation ends; another
    evaluation into the directory meanwhile stops at once with a message naming this one. ``saved_records``: what
    the directory holds (default: per-image outcomes; HessianSpectrum's: per-minibatch spectra)."""
    directory.mkdir(parents=True, exist_ok=True)
    if is_global_zero and locks is not None:
        locks.enter_context(exclusive(directory / LOCK_NAME, f"{owner} outcome folder {directory}"))
    manifest = directory / "manifest.json"
    saved = json.loads(manifest.read_text()) if manifest.is_file() else None
    if saved is not None:
        saved = in_todays_keys(saved, identity)
    if saved == identity:
        return
    if saved is not None:
        changed = sorted(k for k in identity if saved.get(k) != identity[k])
        if saved_records(directory):
            raise UserError(
                f"{directory} holds outcomes of a different evaluation ({', '.join(changed)} differ); set "
                f"{owner}.results_dir to a new directory, or delete it to start over"
            )
        # An evaluation stopped before its first batch was saved (e.g. at a missing dataset root) left its manifest
        # and at most empty or cut-short rank files: nothing of it can be mixed in, so it does not block this one.
        if is_global_zero:
            rank_zero_info(
                f"{directory}: no image's outcome saved by an earlier evaluation with other settings "
                f"({', '.join(changed)}); taking the folder over for this one"
            )
    if is_global_zero:
        atomic_write_json(manifest, identity, default=str)


ADAPTIVE_KEYS_LISTED = 100  # the images an adaptive attack broke that standard AutoAttack had not, named at most


def summarise(outcomes: dict[str, dict[str, Any]], attacks: tuple[str, ...]) -> dict[str, Any]:
    """Clean and robust accuracy, and robust accuracy after each attack, from per-image outcomes; where adaptive
    attacks ran, each one's robust accuracy, the images it broke that standard AutoAttack had not, and the lowest
    figure per image (``reported_robust_accuracy``)."""
    n = len(outcomes)
    if n == 0:
        return {"num_points": 0}
    broken = [o["broken_by"] for o in outcomes.values()]
    after, survivors = {}, sum(o["clean"] for o in outcomes.values())
    for attack in attacks:
        survivors -= broken.count(attack)
        after[attack] = survivors / n
    robust = sum(o["robust"] for o in outcomes.values()) / n
    summary = {
        "num_points": n,
        "clean_accuracy": sum(o["clean"] for o in outcomes.values()) / n,
        "robust_accuracy": robust,
        "robust_accuracy_after": after,
    }
    names = sorted({name for o in outcomes.values() for name in o.get("adaptive", {})})
    if names:
        adaptive = {}
        for name in names:
            figures = {key: o["adaptive"][name] for key, o in outcomes.items() if name in o.get("adaptive", {})}
            newly = sorted(key for key, value in figures.items() if outcomes[key]["robust"] and value < 1)
            adaptive[name] = {
                "robust_accuracy": sum(figures.values()) / len(figures),
                "num_points": len(figures),
                "broke_beyond_autoattack": len(newly),
                "keys_broken_beyond_autoattack": newly[:ADAPTIVE_KEYS_LISTED],
            }
        summary["adaptive"] = adaptive
        summary["reported_robust_accuracy"] = sum(o.get("reported", o["robust"]) for o in outcomes.values()) / n
    return summary


def cell_seconds(directory: Path) -> float:
    """Device-seconds spent on a cell, over every rank and session."""
    total = 0.0
    for path in sorted(directory.glob("rank*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                total += sum(json.loads(line).get("seconds", {}).values())
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
    return round(total, 2)
