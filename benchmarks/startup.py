"""How long does a robust-lightning process take to start and exit, with and without the collector pause?

robust_lightning/startup.py pauses Python's cyclic garbage collector while torch, timm and Lightning import, then
freezes the objects they created (gc.freeze) so that later collections, the exit's included, skip them. In the
command the collector stays off from the package's imports to the end of the command's. This script runs
``robust-lightning --version`` (every import a command makes, no work) in fresh processes:

- as shipped: ``python -m robust_lightning --version``;
- on between the imports: the same imports from ``python -c``, a process that is not the command, where the
  package switches the collector on after its own imports and the command module pauses it again;
- collector on: the collector running throughout, gc.disable and gc.freeze made no-ops before the package imports.

    python benchmarks/startup.py              # about a minute on 2 CPU cores
    python benchmarks/startup.py --runs 9

It prints each variant's median wall and CPU seconds per process, and their ratios to the shipped variant.
"""

import argparse
import resource
import statistics
import subprocess
import sys
import time

RUN_MODULE = "import runpy; runpy.run_module('robust_lightning', run_name='__main__')"
VARIANTS = {
    "as shipped": ["-m", "robust_lightning"],
    "on between the imports": ["-c", RUN_MODULE],
    "collector on": ["-c", "import gc; gc.disable = gc.freeze = lambda: None; " + RUN_MODULE],
}


def one_process(start_with: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of one fresh interpreter started with ``start_with`` and the argument ``--version``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, *start_with, "--version"], check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="processes per variant, interleaved")
    runs = parser.parse_args().runs
    one_process(VARIANTS["as shipped"])  # warms the file cache
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in VARIANTS}
    for _ in range(runs):
        for name, start_with in VARIANTS.items():
            times[name].append(one_process(start_with))
    medians = {}
    for name, samples in times.items():
        medians[name] = statistics.median(w for w, _ in samples), statistics.median(c for _, c in samples)
        wall, cpu = medians[name]
        print(f"{name:>22}: {wall:.2f} s wall, {cpu:.2f} s CPU per process (median of {runs})")
    shipped_wall, shipped_cpu = medians["as shipped"]
    for name in list(VARIANTS)[1:]:
        wall, cpu = medians[name]
        print(f"{name} / as shipped: {wall / shipped_wall:.2f}x wall, {cpu / shipped_cpu:.2f}x CPU")


if __name__ == "__main__":
    main()
