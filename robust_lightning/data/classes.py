"""Class maps: which integer label an image folder (a WordNet id) gets."""

import json
from functools import cache
from pathlib import Path

from robust_lightning.errors import UserError
from robust_lightning.paths import DATA_DIR


@cache
def imagenet_wnids() -> tuple[str, ...]:
    """The 1000 ImageNet-1k WordNet ids in label order (index i = class i)."""
    with open(DATA_DIR / "imagenet_class_index.json") as f:
        index = json.load(f)
    return tuple(index[str(i)][0] for i in range(len(index)))


@cache
def imagenet_class_names() -> tuple[str, ...]:
    with open(DATA_DIR / "imagenet_class_index.json") as f:
        index = json.load(f)
    return tuple(index[str(i)][1] for i in range(len(index)))


def class_map(spec: str, root: str | Path | None = None) -> dict[str, int]:
    """Folder name -> label.

    ``spec`` is ``"imagenet"`` (the standard 1000-class map shipped in data/, so a folder tree with missing
    classes still gets the right labels), ``"folders"`` (the sorted sub-folder names of ``root``, for
    non-ImageNet datasets) or the path of a JSON file mapping folder name -> label.
    """
    if spec == "imagenet":
        return {wnid: i for i, wnid in enumerate(imagenet_wnids())}
    if spec == "folders":
        if root is None or not Path(root).is_dir():
            raise UserError(f"class_map 'folders' needs an existing directory of class folders, got {root!r}")
        names = sorted(p.name for p in Path(root).iterdir() if p.is_dir())
        if not names:
            raise UserError(f"class_map 'folders': {root} has no class sub-folders")
        return {name: i for i, name in enumerate(names)}
    path = Path(spec)
    if not path.is_file():
        raise UserError(
            f"class_map must be 'imagenet', 'folders' or the path of a JSON file; {spec!r} is none of these"
        )
    try:
        mapping = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"class_map file {path} is not valid JSON: {e}") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, int) for v in mapping.values()):
        raise UserError(f"class_map file {path} must hold a JSON object mapping folder name -> integer label")
    return mapping


# Kaggle's ImageNet val labels (LOC_val_solution.csv) start with this header; their PredictionString begins with
# the WNID, followed by bounding boxes.
KAGGLE_HEADER = "ImageId,PredictionString"
VAL_LABELS_FORMATS = (
    "Kaggle's LOC_val_solution.csv, the devkit's ILSVRC2012_validation_ground_truth.txt (with its "
    "meta.mat in the same folder), or one '<file name> <wnid>' line per image "
    "(separated by a space or a comma)"
)
DEVKIT_META = "meta.mat"


def devkit_wnids(meta_path: Path, option: str) -> dict[int, str]:
    """The WNID of each ILSVRC2012_ID (1-1000) in the ImageNet devkit's meta.mat.

    The devkit numbers its classes in its own order, not the sorted-WNID order of ImageNet's standard labels; the
    1000 classes are the synsets without children (devkit readme.txt, section on meta.mat).
    """
    from scipy.io import loadmat  # only this reader needs scipy
    from scipy.io.matlab import MatReadError

    if not meta_path.is_file():
        raise UserError(
            f"{option}: the devkit's class numbers need the devkit's {DEVKIT_META} beside the labels "
            f"file, and {meta_path} does not exist; copy it there from ILSVRC2012_devkit_t12/data/ or "
            f"pass {VAL_LABELS_FORMATS}"
        )
    try:
        synsets = loadmat(str(meta_path), squeeze_me=True)["synsets"]
        return {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets if int(s["num_children"]) == 0}
    except (MatReadError, ValueError, KeyError, TypeError, OSError) as e:
        raise UserError(f"{option}: {meta_path} is not the ImageNet devkit's {DEVKIT_META} ({e})") from None


def read_val_labels(path: str | Path, classes: dict[str, int], option: str) -> dict[str, str]:
    """The WNID of each image of a labels file for a flat folder, by file stem (the name without its extension).

    Formats: Kaggle's LOC_val_solution.csv (``ImageId,PredictionString``, the first word of PredictionString is the
    WNID); the devkit's ILSVRC2012_validation_ground_truth.txt (line i: the ILSVRC2012_ID of
    ILSVRC2012_val_<i, 8 digits>, read with the devkit's meta.mat in the same folder); or lines
    ``<file name> <wnid>`` separated by whitespace or a comma. ``classes`` is the class map the WNIDs must be in;
    ``option`` names the option in error messages (``data.source.val_labels``, ``--val_labels``).
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{option} {path} does not exist; expected {VAL_LABELS_FORMATS}")
    lines = [(n, line.strip()) for n, line in enumerate(path.read_text().splitlines(), start=1) if line.strip()]
    if lines and lines[0][1] == KAGGLE_HEADER:
        lines = lines[1:]
    if not lines:
        raise UserError(f"{option} {path} holds no labels; expected {VAL_LABELS_FORMATS}")
    if all(line.isdigit() for _, line in lines):
        wnids = devkit_wnids(path.parent / DEVKIT_META, option)
        lines = [(number, f"ILSVRC2012_val_{number:08d} {wnids.get(int(line), line)}") for number, line in lines]
    labels: dict[str, str] = {}
    for number, line in lines:
        fields = line.replace(",", " ", 1).split()
        if len(fields) < 2:
            raise UserError(
                f"{option} {path}, line {number}: expected '<file name> <wnid>' (or {KAGGLE_HEADER}), got {line!r}"
            )
        stem, wnid = Path(fields[0]).stem, fields[1]
        if wnid not in classes:
            raise UserError(
                f"{option} {path}, line {number}: {wnid!r} is not a class of the class map "
                "(ImageNet: a WNID such as n01440764)"
            )
        if labels.setdefault(stem, wnid) != wnid:
            raise UserError(f"{option} {path}, line {number}: {fields[0]} is labelled twice, {labels[stem]} and {wnid}")
    return labels


def label_flat_folder(
    folder: str | Path, names: list[str], labels_file: str | Path, classes: dict[str, int], option: str
) -> dict[str, str]:
    """The WNID of each image file ``names`` of the flat ``folder``, from ``labels_file`` (``read_val_labels``);
    every image must be listed there."""
    labels = read_val_labels(labels_file, classes, option)
    missing = [name for name in names if Path(name).stem not in labels]
    if missing:
        raise UserError(
            f"{len(missing)} of the {len(names)} images in {folder} are not in {option} {labels_file} "
            f"(first: {missing[0]}); it must label every image of the folder"
        )
    return {name: labels[Path(name).stem] for name in names}
