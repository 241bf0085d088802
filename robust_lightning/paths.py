"""Where the project's data files live."""

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

# data/ of the checkout holds the class maps and subsets (see data/PROVENANCE.md) and the generated synthetic
# dataset; ROBUST_LIGHTNING_DATA points elsewhere, e.g. on a cluster where the checkout is read-only.
DATA_DIR = Path(os.environ.get("ROBUST_LIGHTNING_DATA", REPO_ROOT / "data"))
