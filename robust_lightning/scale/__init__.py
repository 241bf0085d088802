"""Scale-out on SLURM clusters: grid sweeps as array jobs (``robust-lightning sweep``), one run directory per
cell, and the merged table of their results (``robust-lightning report``). Templates for multi-node training
and evaluation arrays are in slurm/ of the checkout."""
