"""No import points up a layer. From the bottom: the shared modules at the package's top (errors, paths, atomic,
job_signals, argument_parsing, ...), then models, attacks and data, then evaluation and analysis, then training,
then scale, then the command line. A module imports only from its own layer or those below, lazily or not."""

import ast
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "robust_lightning"
LAYERS = {"models": 1, "attacks": 1, "data": 1, "evaluation": 2, "analysis": 2, "training": 3, "scale": 4}
TOP = {"cli": 5, "__main__": 5, "any_model": 5, "__init__": 5}  # the entry points and the Python API


def layer(module: str) -> int:
    """The layer of a module path such as robust_lightning.data.sources (0: the shared modules)."""
    parts = module.split(".")[1:]
    if not parts:
        return 0
    return LAYERS.get(parts[0], TOP.get(parts[0], 0))


def test_no_import_points_up_a_layer():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("robust_lightning"):
                imported = node.module
            elif isinstance(node, ast.Import):
                imported = next((a.name for a in node.names if a.name.startswith("robust_lightning.")), "")
            else:
                continue
            if imported and layer(imported) > layer(module):
                upward.append(f"{path.relative_to(REPO)}:{node.lineno} imports {imported}")
    assert upward == []


def test_the_layers_name_every_package_of_the_project():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert packages == set(LAYERS)
    assert all(Path(PACKAGE, f"{name}.py").is_file() for name in TOP)
