import os

# No network and no W&B in tests.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The cores shared among pytest-xdist's workers (`make test` runs one per core), at most 2 threads each: more
# threads than cores make torch's CPU kernels wait for each other. OMP_NUM_THREADS: the processes tests start.
THREADS = max(1, min(2, (os.cpu_count() or 2) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))))
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))

import torch  # noqa: E402 - after OMP_NUM_THREADS, which torch reads when imported

torch.set_num_threads(THREADS)

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py
# the tests' reference implementations that `make env` installs outside the environment (see the Makefile)
sys.path.append(str(Path(sys.prefix) / "reference"))
