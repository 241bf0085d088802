"""Running at scale: what a cluster job needs beyond one process.

- ``sweep``, ``sweep_spec``, ``task``, ``report``: grid sweeps as SLURM array jobs (``robust-lightning sweep``),
  one run directory per cell, and the merged table of their results (``robust-lightning report``);
- ``requeue``: a SLURM job that SLURM restarts (pre-emption, ``--requeue``) continues its run;
- ``torchrun``: training launched by torchrun, multi-node without SLURM, with its elastic restarts;
- ``workspace``: the project's W&B workspace (``robust-lightning workspace``).

Templates for multi-node training and evaluation arrays are in slurm/ of the checkout.
"""
