"""The declared dependencies (pyproject.toml) against what the code imports: every third-party package the
package or the benchmarks import is a runtime dependency or, imported inside the function of the one feature that
needs it, in that feature's extra; every one the tests import is a runtime or test dependency (or a reference the
Makefile installs), and every declared dependency is imported somewhere (the few that are not say why below).
OpenCV is the headless build, and nothing installed pulls in the GUI one."""

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "robust-lightning"  # as the test extra names the project's own extras: robust-lightning[workspace]

# Declared although they need not be imported by name, each for a reason:
NOT_IMPORTED = {
    "jsonargparse": "LightningCLI (lightning.pytorch.cli) parses the command line and configs with it",
    "ruff": "the linter `make test` runs before the suite (a command, not a module)",
    "pytest-xdist": "a pytest plugin: `make test` passes its -n option",
    "mkdocs-material": "the theme of the manual's site (mkdocs.yml), built by tests/test_docs.py",
    "mkdocstrings": "the API page of the manual's site (docs/api.md), a plugin mkdocs loads",
    "mypy": "the type checker `make test` runs after the linter (a command, not a module)",
    "types-pyyaml": "stubs mypy reads for yaml (never imported)",
    "types-tqdm": "stubs mypy reads for tqdm (never imported)",
    "py-spy": "a command: helpers.run_command prints the stacks of a command that runs past its time limit",
}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> tuple[set[str], set[str]]:
    """The runtime dependencies and the test extra's own packages (less the extras of this project it names)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {normalise(Requirement(r).name) for r in project["dependencies"]}
    test = {normalise(Requirement(r).name) for r in project["optional-dependencies"]["test"]} - {PROJECT}
    return runtime, test


def feature_extras() -> dict[str, set[str]]:
    """The extras other than test, each with the packages of the one feature it serves."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    return {name: {normalise(Requirement(r).name) for r in rs} for name, rs in extras.items() if name != "test"}


def makefile_references() -> set[str]:
    """Packages `make env` installs with --no-deps: test references whose declared requirements must not be
    installed (imagecorruptions requires opencv-python, the GUI build)."""
    pins = re.findall(
        r"pip install --quiet --no-deps (?:--upgrade )?(?:--target \S+ )?(\S+)", (ROOT / "Makefile").read_text()
    )
    return {normalise(Requirement(pin).name) for pin in pins}


def imported_modules(folder: str, module_level: bool = False) -> set[str]:
    """Top-level names of the absolute imports in the folder's .py files, less the standard library and the
    folder's own modules (the tests import their helpers by file name) and the tests' modules (a benchmark that
    measures on the tests' small models puts tests/ on its path). ``module_level``: only the imports a module runs
    when it is imported, outside its functions and classes."""
    names = set()
    for path in (ROOT / folder).rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in module_statements(tree) if module_level else ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    local = {p.stem for f in (folder, "tests") for p in (ROOT / f).glob("*.py")} | {"robust_lightning"}
    return {n for n in names if n not in sys.stdlib_module_names and n not in local}


def module_statements(tree: ast.Module):
    """The nodes a module runs when imported: its statements, and those inside its if / try / with blocks, but
    nothing inside a function or class body, nor an ``if TYPE_CHECKING:`` block (read by type checkers only)."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING":
            stack.extend(node.orelse)
            continue
        yield node
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda):
            stack.extend(ast.iter_child_nodes(node))


def distributions(modules: set[str]) -> set[str]:
    """The installed distributions that provide the modules (e.g. cv2 -> opencv-python-headless)."""
    provided_by = importlib.metadata.packages_distributions()
    missing = sorted(m for m in modules if m not in provided_by)
    assert not missing, f"imported but not installed: {missing}"
    return {normalise(d) for m in modules for d in provided_by[m]}


def test_every_import_is_declared():
    runtime, test = declared()
    optional = set().union(*feature_extras().values())
    package = distributions(imported_modules("robust_lightning") | imported_modules("benchmarks"))
    assert package - runtime - optional == set(), "imported by the package or benchmarks, not declared"
    # an extra's package is imported inside the function that needs it: the package imports without it
    on_import = distributions(
        imported_modules("robust_lightning", module_level=True) | imported_modules("benchmarks", module_level=True)
    )
    assert on_import - runtime == set(), "imported when the package is, not a runtime dependency"
    tests = distributions(imported_modules("tests"))
    assert tests - runtime - test - makefile_references() == set(), "imported by the tests, not declared"
    assert {"braceexpand", "pyautoattack"} <= package  # the two that were once missing


def test_every_declared_dependency_is_imported():
    runtime, test = declared()
    package = distributions(imported_modules("robust_lightning") | imported_modules("benchmarks"))
    tests = distributions(imported_modules("tests"))
    assert runtime - package <= set(NOT_IMPORTED)
    assert test - tests <= set(NOT_IMPORTED)
    assert not (runtime & test), "listed twice"
    for name, packages in feature_extras().items():
        assert packages and packages <= package, f"the extra {name} holds a package the package does not import"
        assert not (packages & (runtime | test)), f"the extra {name} repeats a dependency"


def test_the_tests_install_every_extra():
    """The test extra names every other extra of the project (robust-lightning[...]): the tests run every feature."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = {
        extra for r in extras["test"] if normalise(Requirement(r).name) == PROJECT for extra in Requirement(r).extras
    }
    assert named == set(feature_extras())


def test_jsonargparse_bound_is_lightnings():
    """jsonargparse's range is the one lightning (its pytorch extra, which LightningCLI needs) requires."""
    ours = next(
        Requirement(r)
        for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if Requirement(r).name == "jsonargparse"
    )
    lightnings = [
        Requirement(r)
        for r in importlib.metadata.requires("lightning")
        if r.startswith("jsonargparse") and "pytorch-extra" in r
    ]
    assert lightnings, "lightning no longer lists jsonargparse under its pytorch-extra"
    upper = {s.version for s in lightnings[0].specifier if s.operator == "<"}
    assert upper and upper == {s.version for s in ours.specifier if s.operator == "<"}
    assert "signatures" in ours.extras


def test_the_environment_make_env_builds_passes_pip_check():
    """The reference with unmet requirements lies outside the environment (tests/conftest.py adds it to the tests'
    import path only), so pip finds every requirement of every installed distribution met."""
    check = subprocess.run(
        [sys.executable, "-m", "pip", "check"],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_opencv_is_the_headless_build_alone():
    runtime, _ = declared()
    assert "opencv-python-headless" in runtime and "opencv-python" not in runtime
    assert makefile_references() == {"imagecorruptions"}
    installed = {normalise(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    assert "opencv-python-headless" in installed
    assert "opencv-python" not in installed, "the GUI build is installed beside the headless one"
    # no installed distribution but the --no-deps reference requires the GUI build
    wanting_gui = {
        normalise(d.metadata["Name"])
        for d in importlib.metadata.distributions()
        for r in d.requires or []
        if normalise(Requirement(r).name) == "opencv-python"
        and not (Requirement(r).marker and "extra" in str(Requirement(r).marker))
    }
    assert wanting_gui <= makefile_references()


def test_results_record_the_version_of_everything_that_shapes_a_number():
    import cv2
    import numpy
    import PIL
    import pyautoattack  # noqa: F401 (importable: the reference engine can run)
    import scipy
    import skimage
    import torch

    from robust_lightning.evaluation.results import software_versions

    versions = software_versions()
    # the modules' own version strings, independent of the package metadata software_versions() reads
    assert versions["pillow"] == PIL.__version__
    assert versions["numpy"] == numpy.__version__
    assert versions["scipy"] == scipy.__version__
    assert versions["scikit-image"] == skimage.__version__
    assert versions["opencv"] == cv2.__version__
    assert versions["torch"] == torch.__version__.split("+")[0]  # the wheel metadata drops the local +cuXXX
    # the distributions as installed: the headless OpenCV wheel, not the GUI one
    for name in (
        "pillow",
        "numpy",
        "scipy",
        "scikit-image",
        "opencv-python-headless",
        "pyautoattack",
        "torchvision",
        "lightning",
        "timm",
        "torchmetrics",
        "webdataset",
    ):
        assert versions[name] == importlib.metadata.distribution(name).metadata["Version"], name
    assert "opencv-python" not in versions
    assert "kornia" not in versions  # installed for the tests only: our own warp replaced it (attacks/spatial.py)
    assert versions["opencv-python-headless"].startswith(cv2.__version__)
