"""Learning-rate schedule: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import math


def lr_at(step: int, max_lr: float, min_lr: float, warmup: int, total: int) -> float:
    """The learning rate of optimizer step `step` (0-based) in a run of `total` steps.

    Steps 0..warmup-1 ramp linearly up to max_lr (step 0 already gets max_lr/warmup, never 0, so no step is
    wasted); steps warmup..total-1 follow half a cosine from max_lr down to min_lr; past `total` it stays
    at min_lr (a resumed run with more steps keeps the floor).
    """
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if step >= total:
        return min_lr
    span = max(total - warmup, 1)
    progress = (step - warmup) / span  # 0 at the end of warmup, -> 1 at the last step
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
