"""How long a run trains and at what rate: step and wall-time bounds, warmup, cosine decay."""

from __future__ import annotations

import math
import time

from settings.config import TrainingConfig


def lr_at(step: int, base_lr: float, warmup: int, total: int, time_used: float = 0.0) -> float:
    """Linear warmup, then cosine decay to 10% of ``base_lr`` at ``total`` steps.

    ``time_used`` (0..1, the share of a wall-time cap spent) moves the decay ahead
    when the cap will end the run before ``total``: a capped run still anneals.
    Without either bound the rate stays constant after warmup.
    """
    if warmup and step < warmup:
        return base_lr * (step + 1) / warmup
    by_steps = (step - warmup) / max(1, total - warmup) if total > warmup else 0.0
    progress = min(1.0, max(by_steps, time_used))
    return base_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


class Schedule:
    """The bounds of one run (``max_steps``, ``max_minutes``) and its learning rate per step.

    The wall-time clock starts at :meth:`start`, when the loop does, so loading
    the data, the head and the target does not count against the cap.
    """

    def __init__(self, tc: TrainingConfig) -> None:
        if tc.max_steps <= 0 and tc.max_minutes <= 0:
            raise ValueError("set training.max_steps or training.max_minutes: the run needs a bound")
        self.base_lr, self.warmup, self.total = tc.learning_rate, tc.warmup_steps, tc.max_steps
        self.max_steps = tc.max_steps if tc.max_steps > 0 else (1 << 62)
        self.cap_seconds = tc.max_minutes * 60
        self.deadline: float | None = None

    @property
    def capped(self) -> bool:
        return self.cap_seconds > 0

    def start(self) -> None:
        if self.capped:
            self.deadline = time.monotonic() + self.cap_seconds

    def time_used(self) -> float:
        """The share of the wall-time cap spent (may pass 1.0); 0.0 without a cap."""
        if self.deadline is None:
            return 0.0
        return 1.0 - (self.deadline - time.monotonic()) / self.cap_seconds

    def lr(self, step: int, time_used: float = 0.0) -> float:
        return lr_at(step, self.base_lr, self.warmup, self.total, time_used)
