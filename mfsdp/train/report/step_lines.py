"""Progress as plain lines for batch logs (``--train.progress false``, as under Slurm, where a
progress bar's carriage returns make one unreadable line): every ``--metrics.log_every`` steps,
and at the first and last, the step, the objective's metrics, learning rate, tokens per second and time left."""

from __future__ import annotations


class StepLines:
    """A log of ``Trainer``'s tuple (``write`` takes each step's metrics record) that prints a line
    every ``log_every`` steps; the ETA is the mean step time since the last line times the steps left."""

    def __init__(self, cfg, start_step: int, objective, enabled: bool, log):
        self.enabled, self.log, self.objective = enabled, log, objective
        self.every, self.steps, self.first = cfg.metrics.log_every, cfg.train.steps, start_step + 1
        self._seconds = self._count = 0

    def write(self, record: dict) -> None:
        if not self.enabled:
            return
        step = record["step"]
        if step > self.first:  # the first step's time is mostly warm-up (and compile): not a rate
            self._seconds, self._count = self._seconds + record["step_time_s"], self._count + 1
        if step % self.every and step not in (self.first, self.steps):
            return
        per_step = self._seconds / self._count if self._count else record["step_time_s"]
        self._seconds = self._count = 0
        self.log(f"step {step}/{self.steps}: {self.objective.summary(record, 4)}, lr {record['lr']:.3g}, "
                 f"{record['tokens_per_s']:,.0f} tok/s, ETA {duration(per_step * (self.steps - step))}")

    def close(self) -> None:
        pass


def duration(seconds: float) -> str:
    """``seconds`` as 1h02m, 3m05s or 42s."""
    seconds = round(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"
