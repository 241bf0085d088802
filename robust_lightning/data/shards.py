"""ImageFolder -> WebDataset shards, plus the shard/manifest code shared with the synthetic dataset.

Layout of an output directory (the contract the data module reads):

- ``{prefix}-{index:06d}.tar``: WebDataset shards. Each sample has ``__key__`` (unique, no dots), the image
  bytes exactly as in the source file under ``jpg`` / ``png`` / ``webp``, ``cls`` (integer label, ASCII
  digits) and ``wnid`` (class folder name, so labels can be remapped later).
- ``manifest.json``: totals, class counts per shard, skipped files; see :func:`write_manifest`.
- ``.plan.json`` and ``{prefix}-{index:06d}.json``: the converter's plan and per-shard stats, which make an
  interrupted conversion resumable.

Every file is written under a temporary name in the same directory and then renamed, so a killed run never
leaves a half-written file under its final name.
"""

from __future__ import annotations

import inspect
import io
import json
import os
import re
import sys
import textwrap
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import webdataset as wds
from PIL import Image

from robust_lightning.atomic import atomic_write, atomic_write_json
from robust_lightning.console import tqdm
from robust_lightning.data.classes import VAL_LABELS_FORMATS, label_flat_folder
from robust_lightning.data.classes import class_map as resolve_class_map
from robust_lightning.errors import UserError, user_command
from robust_lightning.job_signals import pool_map
from robust_lightning.locking import LOCK_NAME, exclusive

MANIFEST_FORMAT = "robust-lightning-shards/1"
MANIFEST_NAME = "manifest.json"
PLAN_NAME = ".plan.json"
# The converter's options that decide what it writes (saved in its plan and the manifest); workers and
# overwrite do not.
CONVERSION_OPTIONS = ("prefix", "samples_per_shard", "class_map", "shuffle", "seed", "verify", "val_labels")

# Source file suffix -> sample extension; the bytes are stored as they are, so the extension names their format.
IMAGE_EXTENSIONS = {".jpg": "jpg", ".jpeg": "jpg", ".png": "png", ".webp": "webp"}
# What PIL reports when it decodes a file: a ".JPEG" that really holds a PNG (ImageNet has a few) is stored
# under the extension of its real format.
PIL_FORMATS = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}

# A shard sample (``__key__``, the image bytes under their extension, ``cls``, ``wnid``), and the JSON objects of a
# shard directory (a shard's stats, the manifest, the converter's plan): their fields are named where they are
# written (write_shard, write_manifest, _make_plan).
Sample = dict[str, Any]
JSONObject = dict[str, Any]


def _version() -> str:
    from robust_lightning import __version__

    return __version__


# --------------------------------------------------------------------------------------------------------------
# Writing shards and manifests (shared with robust_lightning.data.synthetic)
# --------------------------------------------------------------------------------------------------------------


def shard_name(prefix: str, index: int) -> str:
    return f"{prefix}-{index:06d}.tar"


def write_json_atomic(path: str | Path, obj: object, indent: int | None = 1) -> None:
    atomic_write_json(path, obj, indent=indent)


def write_shard(path: str | Path, samples: Iterable[Sample]) -> JSONObject:
    """Write ``samples`` into the tar file ``path`` atomically; return the shard's stats.

    Each sample is a dict with ``__key__`` (no dots or slashes), the encoded image bytes under ``jpg``, ``png``
    or ``webp``, ``cls`` (int) and ``wnid`` (str). Stats: ``{"file", "num_samples", "bytes", "class_counts":
    {label: n}, "wnid_counts": {wnid: n}}`` (JSON-ready: labels are string keys).
    """
    path = Path(path)
    labels: Counter[int] = Counter()
    wnids: Counter[str] = Counter()
    with atomic_write(path, "wb") as f:
        # A fixed mtime makes the tar a pure function of the samples (reproducible, comparable runs);
        # PAX allows member names longer than 100 characters.
        with wds.TarWriter(f, mtime=0, format="PAX_FORMAT") as writer:
            for sample in samples:
                key = sample["__key__"]
                if not key or "." in key or "/" in key:
                    raise ValueError(f"sample key {key!r} must be non-empty and contain no '.' or '/'")
                writer.write(sample)
                labels[int(sample["cls"])] += 1
                wnids[sample["wnid"]] += 1
    return {
        "file": path.name,
        "num_samples": sum(labels.values()),
        "bytes": path.stat().st_size,
        "class_counts": {str(label): labels[label] for label in sorted(labels)},
        "wnid_counts": dict(sorted(wnids.items())),
    }


def write_manifest(
    out: str | Path,
    shard_stats: list[JSONObject],
    *,
    class_map: str,
    labels: dict[str, int],
    source: str,
    skipped: Iterable[dict[str, str]] = (),
    options: JSONObject | None = None,
) -> JSONObject:
    """Write ``out/manifest.json`` atomically from the per-shard stats of :func:`write_shard`; return it.

    ``class_map`` is the spec string the labels came from, ``labels`` the resolved folder name -> label map,
    ``options`` the converter's options (recorded so that an error about a damaged shard can name the command
    that rewrites it).
    """
    wnid_counts: Counter[str] = Counter()
    for stats in shard_stats:
        wnid_counts.update(stats["wnid_counts"])
    present = sorted(wnid_counts, key=lambda name: (labels[name], name))
    manifest = {
        "format": MANIFEST_FORMAT,
        "num_samples": sum(s["num_samples"] for s in shard_stats),
        # Labels run 0..K-1; a many-to-one JSON map (e.g. ImageNet -> 9 super-classes) has K < len(map).
        "num_classes": max(labels.values()) + 1 if labels else 0,
        "class_map": class_map,
        "classes": present,
        "class_counts": {name: wnid_counts[name] for name in present},
        "shards": [{key: s[key] for key in ("file", "num_samples", "bytes", "class_counts")} for s in shard_stats],
        "skipped": list(skipped),
        "source": source,
        **({"options": options} if options is not None else {}),
        "created_by": f"robust-lightning {_version()}",
    }
    write_json_atomic(Path(out) / MANIFEST_NAME, manifest)
    return manifest


# --------------------------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------------------------


def read_manifest(directory: str | Path) -> JSONObject | None:
    """The manifest of a shard directory, or None if it has none."""
    path = Path(directory) / MANIFEST_NAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e}); re-create the shards") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise UserError(
            f"{path} is not a {MANIFEST_FORMAT} manifest; re-create the shards with 'robust-lightning shards'"
        )
    return manifest


def shard_urls(directory: str | Path, check_sizes: bool = True) -> list[str]:
    """Paths of the shards listed in ``directory/manifest.json``, in manifest order. ``check_sizes``: refuse
    shards whose size differs from the manifest (off: read what is there and count what is missing)."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        raise UserError(
            f"{directory} has no {MANIFEST_NAME}; expected a shard directory written by 'robust-lightning shards'"
        )
    urls = [directory / s["file"] for s in manifest["shards"]]
    missing = [p.name for p in urls if not p.is_file()]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise UserError(
            f"{directory}: shard(s) listed in {MANIFEST_NAME} are missing: {', '.join(missing[:3])}{more}; "
            f"{repair_hint(directory)}"
        )
    # a truncated copy can end exactly between two tar members, which tarfile reads as a normal end
    resized = [
        f"{p.name} ({p.stat().st_size} bytes, the manifest says {s['bytes']})"
        for p, s in zip(urls, manifest["shards"])
        if "bytes" in s and p.stat().st_size != s["bytes"]
    ]
    if resized and check_sizes:
        raise UserError(
            f"{directory}: shard(s) truncated or changed since they were written: "
            f"{', '.join(resized[:3])}; {repair_hint(directory)}"
        )
    return [str(p) for p in urls]


def repair_hint(directory: str | Path) -> str:
    """How to rewrite the missing or damaged shards of a shard directory, for an error message: the exact
    ``robust-lightning shards`` command where the manifest (or the converter's plan beside it) records the
    conversion; a re-run of it rewrites just those shards."""
    directory = Path(directory).resolve()
    try:
        manifest = read_manifest(directory) or {}
    except UserError:
        manifest = {}
    if manifest.get("class_map") == "synthetic":
        return (
            f"the shards belong to the built-in synthetic dataset: delete {directory.parent} and run again to "
            "generate it anew"
        )
    options = manifest.get("options")
    if options is None:  # manifests of earlier versions: the plan holds the same options
        options = _read_json(directory / PLAN_NAME) or {}
    source = manifest.get("source", options.get("source"))
    if "prefix" not in options or source is None:
        where = f" from {source}" if source else ""
        return (
            f"to rewrite the damaged shards, run the robust-lightning shards command that wrote {directory}{where} "
            "again, with the same options"
        )
    defaults = {name: p.default for name, p in inspect.signature(shards).parameters.items()}
    defaults["prefix"] = Path(source).name
    words = ["shards", source, str(directory)]
    for name in CONVERSION_OPTIONS:
        value = options.get(name, defaults[name])
        if value != defaults[name]:
            words += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
    if not (directory / PLAN_NAME).is_file():  # without its plan the converter cannot tell what to keep
        words += ["--overwrite", "true"]
    return f"to rewrite the damaged shards, run: {user_command(*words)}"


# --------------------------------------------------------------------------------------------------------------
# Converter
# --------------------------------------------------------------------------------------------------------------


def _scan_image_folder(src: Path, val_labels: str | None) -> list[str]:
    """Sorted image paths relative to ``src``, each ``<class folder>/.../<file>``, or with ``val_labels`` (a
    flat folder) the file names."""
    loose = sorted(
        p.name
        for p in src.iterdir()
        if p.is_file() and not p.name.startswith(".") and p.suffix.lower() in IMAGE_EXTENSIONS
    )
    if val_labels is not None:
        if not loose:
            raise UserError(
                f"--val_labels labels the images of a flat folder, but {src} holds none directly; "
                "for an ImageFolder tree SRC/<class folder>/<images> leave --val_labels out"
            )
        return loose
    if loose:
        raise UserError(
            f"{src} holds images directly (e.g. {loose[0]}); expected an ImageFolder tree SRC/<class folder>/<images>, "
            f"or for a flat folder such as ImageNet's val, --val_labels FILE: {VAL_LABELS_FORMATS}"
        )
    files: list[str] = []
    for folder in sorted(e.name for e in os.scandir(src) if e.is_dir() and not e.name.startswith(".")):
        for dirpath, dirnames, filenames in os.walk(src / folder, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            rel = Path(dirpath).relative_to(src).as_posix()
            # Hidden files are skipped: e.g. macOS "._n01440764_10026.JPEG" metadata files are not images.
            files.extend(
                f"{rel}/{name}"
                for name in sorted(filenames)
                if not name.startswith(".") and Path(name).suffix.lower() in IMAGE_EXTENSIONS
            )
    return files


def _sample_keys(files: list[str]) -> dict[str, str]:
    """Relative path -> sample key (a function of the file list, so the plan need not store keys)."""
    # ImageNet file stems are unique (n01440764_10026, ILSVRC2012_val_00000001); other trees may repeat a stem
    # across folders, then the whole relative path becomes the key. Dots would split the key in webdataset.
    keys = [Path(f).stem.replace(".", "_") for f in files]
    if len(set(keys)) < len(keys):
        keys = [f.replace("/", "_").replace(".", "_") for f in files]
    if len(set(keys)) < len(keys):
        dup = next(k for k, n in Counter(keys).items() if n > 1)
        raise UserError(f"two source files map to the same sample key {dup!r}; rename one of them")
    return dict(zip(files, keys))


def _make_plan(
    src: Path,
    *,
    prefix: str,
    samples_per_shard: int,
    class_map: str,
    shuffle: bool,
    seed: int,
    verify: bool,
    val_labels: str | None,
) -> tuple[JSONObject, dict[str, str]]:
    """The conversion plan (saved to compare on resume) and the sample key of each file."""
    labels = resolve_class_map(class_map, src)
    files = _scan_image_folder(src, val_labels)
    if not files:
        exts = ", ".join(sorted(IMAGE_EXTENSIONS))
        raise UserError(f"{src} contains no images ({exts}) in class folders; expected SRC/<class folder>/<images>")
    # a flat folder: each file's class from the labels file, which checks its classes against the map
    wnids = None if val_labels is None else label_flat_folder(src, files, val_labels, labels, "--val_labels")
    folders = sorted({f.split("/", 1)[0] for f in files}) if wnids is None else []
    unknown = [name for name in folders if name not in labels]
    if unknown:
        names = ", ".join(unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        if class_map == "imagenet":
            raise UserError(
                f"class folder(s) {names} in {src} are not ImageNet wnids (expected names like n01440764); "
                "for another dataset use class_map 'folders' (--class_map folders) or a JSON class map file"
            )
        raise UserError(f"class folder(s) {names} in {src} are not in the class map {class_map!r}")
    keys = _sample_keys(files)
    order = np.random.default_rng(seed).permutation(len(files)) if shuffle else np.arange(len(files))
    files = [files[i] for i in order.tolist()]
    plan = {
        "format": MANIFEST_FORMAT,
        "source": str(src),
        "prefix": prefix,
        "samples_per_shard": samples_per_shard,
        "class_map": class_map,
        "shuffle": shuffle,
        "seed": seed,
        "verify": verify,
        # The whole resolved map: num_classes comes from it, and an edited class map file is a different plan.
        "labels": labels,
        "shards": [files[i : i + samples_per_shard] for i in range(0, len(files), samples_per_shard)],
    }
    if wnids is not None:  # only then: the plans of class folder trees stay those of earlier versions (resume)
        plan.update(val_labels=val_labels, wnids=wnids)
    return plan, keys


def _wnid(plan: JSONObject, rel: str) -> str:
    """The class folder name of a planned file: its first folder, or its entry in a flat folder's labels."""
    return plan["wnids"][rel] if "wnids" in plan else rel.split("/", 1)[0]


def _shard_paths(out: Path, prefix: str) -> list[Path]:
    pattern = re.compile(rf"^\.?{re.escape(prefix)}-\d{{6}}\.(tar|json)(\.tmp-\d+)?$")
    return [p for p in out.iterdir() if pattern.match(p.name)]


def _clear_output(out: Path, prefixes: set[str]) -> None:
    for prefix in prefixes:
        for path in _shard_paths(out, prefix):
            path.unlink()
    for name in (MANIFEST_NAME, PLAN_NAME):
        (out / name).unlink(missing_ok=True)


def _prepare_output(out: Path, plan: JSONObject, overwrite: bool) -> None:
    """Create ``out`` and save the plan there, or check that it matches the saved one (resume)."""
    out.mkdir(parents=True, exist_ok=True)
    plan_path = out / PLAN_NAME
    old: JSONObject | None = None
    if plan_path.is_file():
        try:
            old = json.loads(plan_path.read_text())
        except json.JSONDecodeError:
            old = {}
    if overwrite:
        prefix: str = plan["prefix"]
        _clear_output(out, {prefix, (old or {}).get("prefix", prefix)})
        old = None
    if old is not None:
        if old == plan:
            # Resume: temp files of a killed run are garbage (their shards get written again).
            for path in _shard_paths(out, plan["prefix"]):
                if ".tmp-" in path.name:
                    path.unlink()
            return
        raise UserError(
            f"{out} holds shards from a different conversion (other source files or options); "
            "use a new output directory or --overwrite (overwrite=True) to replace them"
        )
    if (out / MANIFEST_NAME).exists() or _shard_paths(out, plan["prefix"]):
        raise UserError(
            f"{out} already holds shards or a manifest that this converter did not plan; "
            "use a new output directory or --overwrite (overwrite=True) to replace them"
        )
    write_json_atomic(plan_path, plan, indent=None)  # compact: ImageNet train lists 1.28M files


def _read_source_sample(path: Path, key: str, label: int, wnid: str, verify: bool) -> tuple[Sample | None, str | None]:
    """The sample for one source file, or (None, reason) if it cannot be read or (with verify) decoded."""
    try:
        data = path.read_bytes()
    except OSError as e:
        return None, f"cannot read: {e}"
    ext = IMAGE_EXTENSIONS[path.suffix.lower()]
    if verify:
        try:
            with Image.open(io.BytesIO(data)) as image:
                fmt = image.format
                image.convert("RGB")  # decodes every pixel: catches truncated and corrupt files
        except Exception as e:  # PIL raises many types (OSError, SyntaxError, ValueError, DecompressionBomb...)
            # without PIL's name for the in-memory buffer, whose address would change the manifest on every run
            message = re.sub(r"\s*<_io\.BytesIO object at 0x[0-9a-fA-F]+>", "", str(e))
            return None, f"cannot decode: {type(e).__name__}: {message}"
        ext = PIL_FORMATS.get(fmt, ext) if fmt is not None else ext
    return {"__key__": key, ext: data, "cls": label, "wnid": wnid}, None


def _convert_shard(
    src: Path,
    out: Path,
    prefix: str,
    index: int,
    entries: list[tuple[str, str, str]],
    labels: dict[str, int],
    verify: bool,
) -> JSONObject:
    """Worker task: write one shard of ``entries`` (relative path, sample key, class folder name), then its stats
    file (the stats file marks the shard as done)."""
    skipped = []

    def samples() -> Iterator[Sample]:
        for rel, key, wnid in entries:
            sample, reason = _read_source_sample(src / rel, key, labels[wnid], wnid, verify)
            if sample is None:
                skipped.append({"path": str(src / rel), "reason": reason})
            else:
                yield sample

    stats = write_shard(out / shard_name(prefix, index), samples())
    stats["skipped"] = skipped
    write_json_atomic(_stats_path(out, prefix, index), stats)
    return stats


def _stats_path(out: Path, prefix: str, index: int) -> Path:
    return (out / shard_name(prefix, index)).with_suffix(".json")


def _read_json(path: Path) -> JSONObject | None:
    try:
        content: JSONObject | None = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return content


def _shard_state(out: Path, prefix: str, index: int, listed: JSONObject | None) -> tuple[JSONObject | None, str | None]:
    """(the stats of a finished, intact shard, or None if it has to be written; why a shard recorded as finished
    (by its stats file, or ``listed`` in the manifest) is written again, or None)."""
    tar = out / shard_name(prefix, index)
    stats = _read_json(_stats_path(out, prefix, index))
    record = stats or listed
    if record is None:  # never finished (an interrupted conversion): written, nothing to report
        return None, None
    if not tar.is_file():
        return None, "missing"
    # Shards are renamed into place whole, so a size as recorded is the whole file; reading every shard to its
    # end instead would take minutes on an ImageNet conversion, at every resume.
    size = tar.stat().st_size
    if "bytes" in record and size != record["bytes"]:
        return None, f"{size} of {record['bytes']} bytes"
    return stats, None  # None when only the manifest lists it (stats file gone): written again


def convert_image_folder(
    src: str | Path,
    out: str | Path,
    *,
    prefix: str | None = None,
    samples_per_shard: int = 1000,
    class_map: str = "imagenet",
    shuffle: bool = True,
    seed: int = 0,
    verify: bool = True,
    val_labels: str | Path | None = None,
    workers: int | None = os.cpu_count(),
    progress: bool = True,
    overwrite: bool = False,
) -> JSONObject:
    """Convert an ImageFolder tree ``src/<class folder>/<images>`` into WebDataset shards in ``out``; with
    ``val_labels`` (see ``robust_lightning.data.classes.read_val_labels``), a flat folder of images.

    The plan (sorted files, seeded permutation if ``shuffle``, chunks of ``samples_per_shard``) is
    deterministic and saved in ``out``; re-running with the same arguments only writes the shards that are
    missing, or whose size differs from the one recorded when they were written (those it names). With ``verify``
    every image is decoded and undecodable ones are left out and listed in the manifest's ``skipped``. Returns
    the manifest.
    """
    src = Path(src).resolve()
    out = Path(out).resolve()
    if not src.is_dir():
        raise UserError(
            f"source directory {src} does not exist; expected an ImageFolder tree SRC/<class folder>/<images>"
        )
    if out == src or src in out.parents:
        raise UserError(f"output directory {out} must not be inside the source directory {src}")
    if samples_per_shard < 1:
        raise UserError(f"samples_per_shard must be at least 1, got {samples_per_shard}")
    workers = workers or 1
    if workers < 1:
        raise UserError(f"workers must be at least 1, got {workers}")
    prefix = prefix or src.name
    if "/" in prefix or "." in prefix:
        raise UserError(f"prefix {prefix!r} must not contain '/' or '.'")

    plan, keys = _make_plan(
        src,
        prefix=prefix,
        samples_per_shard=samples_per_shard,
        class_map=class_map,
        shuffle=shuffle,
        seed=seed,
        verify=verify,
        val_labels=None if val_labels is None else str(Path(val_labels).resolve()),
    )
    # One converter per output directory: a second one would delete the first's temporary files as leftovers
    # of a killed run, and the two would write the manifest over each other.
    with exclusive(out / LOCK_NAME, f"shard directory {out}"):
        return _convert(src, out, plan, keys, overwrite=overwrite, workers=workers, progress=progress)


def _convert(
    src: Path, out: Path, plan: JSONObject, keys: dict[str, str], *, overwrite: bool, workers: int, progress: bool
) -> JSONObject:
    """The shards of ``plan`` that ``out`` lacks or holds damaged, then the manifest (under the directory's lock)."""
    prefix, verify, class_map = plan["prefix"], plan["verify"], plan["class_map"]
    _prepare_output(out, plan, overwrite)

    num_shards = len(plan["shards"])
    listed = {s["file"]: s for s in (_read_json(out / MANIFEST_NAME) or {}).get("shards", [])}
    states = [_shard_state(out, prefix, i, listed.get(shard_name(prefix, i))) for i in range(num_shards)]
    stats: list[JSONObject | None] = [state for state, _ in states]
    damaged = [f"{shard_name(prefix, i)} ({why})" for i, (_, why) in enumerate(states) if why]
    todo = [i for i in range(num_shards) if stats[i] is None]
    args = [
        (src, out, prefix, i, [(f, keys[f], _wnid(plan, f)) for f in plan["shards"][i]], plan["labels"], verify)
        for i in todo
    ]
    with tqdm(
        total=num_shards, initial=num_shards - len(todo), desc=f"{prefix} shards", unit="shard", disable=not progress
    ) as bar:
        if workers == 1 or len(todo) <= 1:
            for a in args:
                stats[a[3]] = _convert_shard(*a)
                bar.update()
        else:
            for a, shard_stats in zip(args, pool_map(_convert_shard, args, workers, bar.update)):
                stats[a[3]] = shard_stats
    if damaged:
        print(f"Rewrote {len(damaged)} missing or damaged shard(s) of {out}: {', '.join(damaged)}", flush=True)

    done = cast(list[JSONObject], stats)  # every shard's stats: the pool finished them all
    skipped = [item for s in done for item in s["skipped"]]
    options = {name: plan[name] for name in CONVERSION_OPTIONS if name in plan}
    return write_manifest(
        out, done, class_map=class_map, labels=plan["labels"], source=str(src), skipped=skipped, options=options
    )


# --------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------


def shards(
    src: str,
    out: str,
    prefix: str | None = None,
    samples_per_shard: int = 1000,
    class_map: str = "imagenet",
    shuffle: bool = True,
    seed: int = 0,
    verify: bool = True,
    val_labels: str | None = None,
    workers: int | None = None,
    overwrite: bool = False,
) -> int:
    """Convert an ImageFolder tree (SRC/<class folder>/<images>) into WebDataset shards in OUT.

    Args:
        src: ImageFolder root: SRC/<class folder>/<images>, or a flat folder of images with val_labels
        out: output directory for the shards and manifest.json
        prefix: shard file prefix (default: the name of SRC, e.g. 'train')
        samples_per_shard: images per shard (1000 is ~110 MB for ImageNet)
        class_map: labels: 'imagenet' (the standard 1000-class order), 'folders' (sorted folder names) or a
            JSON file mapping folder name -> label
        shuffle: shuffle the files with seed so every shard mixes classes; false keeps the sorted order
            (for validation sets)
        seed: shuffle seed
        verify: decode every image to check it (false is faster; corrupt files then end up in shards)
        val_labels: the labels of a flat SRC (ImageNet's val as distributed): Kaggle's LOC_val_solution.csv, or
            one '<file name> <wnid>' line per image (separated by a space or a comma)
        workers: parallel processes, one shard each (default: the number of CPUs)
        overwrite: delete shards and plan of an earlier, different conversion in OUT first
    """
    manifest = convert_image_folder(
        src,
        out,
        prefix=prefix,
        samples_per_shard=samples_per_shard,
        class_map=class_map,
        shuffle=shuffle,
        seed=seed,
        verify=verify,
        val_labels=val_labels,
        workers=workers or os.cpu_count(),
        overwrite=overwrite,
    )
    size = sum(s["bytes"] for s in manifest["shards"]) / 1e9
    print(
        f"Wrote {manifest['num_samples']} samples of {len(manifest['classes'])} classes "
        f"(class map {manifest['class_map']!r}, {manifest['num_classes']} labels) into "
        f"{len(manifest['shards'])} shards ({size:.2f} GB); skipped {len(manifest['skipped'])} undecodable "
        f"files{' (listed in the manifest)' if manifest['skipped'] else ''}. "
        f"Manifest: {Path(out).resolve() / MANIFEST_NAME}"
    )
    return 0


def shards_main(argv: list[str] | None = None) -> int:
    from robust_lightning.argument_parsing import run_tool

    description = textwrap.dedent(
        """\
        Convert an ImageFolder tree (SRC/<class folder>/<images>) into WebDataset shards in OUT, with a
        manifest.json the data module reads. Image bytes are stored as they are (no re-encoding); each
        sample also holds its integer label (cls) and class folder name (wnid). Conversion is parallel
        and resumable: re-run the same command after an interruption, or when a shard went missing or was
        truncated, and only the missing or damaged shards are written.

        Example (ImageNet; a flat val folder, as distributed, needs its labels file):
          robust-lightning shards /datasets/imagenet/train /datasets/imagenet-wds/train
          robust-lightning shards /datasets/imagenet/val /datasets/imagenet-wds/val --shuffle false
          robust-lightning shards /datasets/imagenet/val /datasets/imagenet-wds/val --shuffle false \\
              --val_labels LOC_val_solution.csv
        """
    )
    return run_tool(
        shards, sys.argv[1:] if argv is None else argv, prog="robust-lightning shards", description=description
    )
