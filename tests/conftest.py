import os

# No network and no W&B in tests; a small thread count keeps the 2-core CI machine responsive.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

torch.set_num_threads(2)

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))  # tests/helpers.py
