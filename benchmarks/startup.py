"""How long does a robust-lightning process take to start and exit, with and without the collector pause?

robust_lightning/startup.py pauses Python's cyclic garbage collector while torch, timm and Lightning import, then
freezes the objects they created (gc.freeze) so that later collections, the exit's included, skip them. This
script runs ``python -m robust_lightning --version`` (every import a command makes, no work) in fresh processes:

- as shipped;
- with the collector running throughout: gc.disable and gc.freeze made no-ops before the package imports.

    python benchmarks/startup.py              # about a minute on 2 CPU cores
    python benchmarks/startup.py --runs 9

It prints each variant's median wall and CPU seconds per process, and their ratio.
"""

import argparse
import resource
import statistics
import subprocess
import sys
import time

SHIPPED = "import runpy; runpy.run_module('robust_lightning', run_name='__main__')"
COLLECTOR_ON = "import gc; gc.disable = gc.freeze = lambda: None; " + SHIPPED


def one_process(code: str) -> tuple[float, float]:
    """Wall and CPU seconds of one fresh interpreter running ``code`` with the arguments ``--version``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code, "--version"], check=True, capture_output=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="processes per variant, interleaved")
    runs = parser.parse_args().runs
    variants = {"as shipped": SHIPPED, "collector on": COLLECTOR_ON}
    one_process(SHIPPED)  # warms the file cache
    times = {name: [] for name in variants}
    for _ in range(runs):
        for name, code in variants.items():
            times[name].append(one_process(code))
    medians = {}
    for name, samples in times.items():
        wall = statistics.median(w for w, _ in samples)
        cpu = statistics.median(c for _, c in samples)
        medians[name] = wall
        print(f"{name:>13}: {wall:.2f} s wall, {cpu:.2f} s CPU per process (median of {runs})")
    print(f"collector on / as shipped: {medians['collector on'] / medians['as shipped']:.2f}x wall")


if __name__ == "__main__":
    main()
