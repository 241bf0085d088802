"""Learning-rate schedule of the recipe: linear warm-up to the peak, then cosine decay, updated every step."""

import math


def warmup_cosine(step: int, total_steps: float, warmup_steps: int, peak_lr: float, min_lr: float) -> float:
    """Learning rate at optimiser step ``step`` (0-based)."""
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return min_lr + (peak_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
