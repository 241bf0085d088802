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
        raise UserError(f"class_map must be 'imagenet', 'folders' or the path of a JSON file; "
                        f"{spec!r} is none of these")
    try:
        mapping = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"class_map file {path} is not valid JSON: {e}") from None
    if not isinstance(mapping, dict) or not all(isinstance(v, int) for v in mapping.values()):
        raise UserError(f"class_map file {path} must hold a JSON object mapping folder name -> integer label")
    return mapping
