"""No import points up a layer. From the bottom: the shared modules at the package's top (errors, paths, atomic,
job_signals, argument_parsing, devices, ...), then models, attacks and data, which import nothing of each other,
then evaluation and analysis, then training, then scale, then the command line. A module imports only from its
own layer or those below, lazily or not, whether it names the module in full, relative to its own package, or as a
name of the package above it."""

import ast
from pathlib import Path

from helpers import REPO

PACKAGE = REPO / "robust_lightning"
LAYERS = {"models": 1, "attacks": 1, "data": 1, "evaluation": 2, "analysis": 2, "training": 3, "scale": 4}
TOP = {"cli": 5, "__main__": 5, "any_model": 5, "__init__": 5}  # the entry points and the Python API
SEPARATE = {"models", "attacks", "data"}  # the lowest layer's packages, none of which imports another


def layer(module: str) -> int:
    """The layer of a module path such as robust_lightning.data.sources (0: the shared modules)."""
    parts = module.split(".")[1:]
    if not parts:
        return 0
    return LAYERS.get(parts[0], TOP.get(parts[0], 0))


def imported_modules(module: str, node: ast.AST) -> list[str]:
    """The project's modules that an import statement in ``module`` names, in full: a relative import is resolved
    against the module's package (``module`` keeps ``__init__`` for a package's own file), and each name of a
    ``from`` import is taken as a module of the one it comes from (``from robust_lightning import training``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == "robust_lightning"]
    if not isinstance(node, ast.ImportFrom):
        return []
    source = node.module or ""
    if node.level:  # "from ..training import x" in robust_lightning.data.augment: robust_lightning.training
        package = module.split(".")[: -node.level]
        source = ".".join(package + ([source] if source else []))
    if source.split(".")[0] != "robust_lightning":
        return []
    return [f"{source}.{alias.name}" for alias in node.names]


def upward_imports(module: str, code: str) -> list[str]:
    """The imports in ``code``, the source of ``module``, that point up a layer or across the lowest one."""
    found = []
    own = module.split(".")[1] if module.count(".") else ""
    for node in ast.walk(ast.parse(code)):
        for imported in imported_modules(module, node):
            other = imported.split(".")[1] if imported.count(".") else ""
            across = own in SEPARATE and other in SEPARATE and other != own
            if layer(imported) > layer(module) or across:
                found.append(f"{module}:{node.lineno} imports {imported}")
    return found


def test_no_import_points_up_a_layer():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        upward += upward_imports(module, path.read_text())
    assert upward == []


def test_the_check_sees_every_form_of_an_import():
    module = "robust_lightning.data.probe"
    for code in (
        "from robust_lightning import training",
        "from ..training import lightning_module",
        "from .. import training",
        "import robust_lightning.training.schedule",
        "from robust_lightning.training.schedule import x",
        "def lazy():\n    from ..training.schedule import x",
        "from robust_lightning.attacks.projections import lp_norm",
        "from ..attacks import apgd",
    ):
        assert len(upward_imports(module, code)) == 1, code
    # a package's own file: "from . import x" stays in the package, ".." is the package above it
    assert upward_imports("robust_lightning.data.__init__", "from . import augment") == []
    assert upward_imports("robust_lightning.data.__init__", "from .. import training") != []
    for code in (
        "from robust_lightning import errors, __version__",
        "from . import batching",
        "from .batching import GlobalBatch",
        "from .. import paths",
        "import robust_lightning",
        "import torch",
    ):
        assert upward_imports(module, code) == [], code


def test_the_layers_name_every_package_of_the_project():
    packages = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert packages == set(LAYERS)
    assert {name for name, number in LAYERS.items() if number == 1} == SEPARATE
    assert all(Path(PACKAGE, f"{name}.py").is_file() for name in TOP)
