"""Per-step measurements: the metrics.jsonl file, step timing and peak memory."""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch


class MetricsLog:
    """Appends one JSON object per step to ``path`` (rank 0 only).

    On resume, lines after the resumed step are dropped first: they belong to the
    interrupted run's future, which is about to be recomputed, so the file keeps one
    consistent history.
    """

    def __init__(self, path: Path, enabled: bool, keep_until_step: int = 0):
        self.path = Path(path)
        self._file = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if keep_until_step > 0 and self.path.is_file():
            for line, record in _parsed_lines(self.path):
                try:
                    if record["step"] <= keep_until_step:
                        kept.append(line)
                except (KeyError, TypeError):
                    continue  # cut short by the interruption, yet valid JSON (say "12")
        self.path.write_text("".join(line + "\n" for line in kept))
        self._file = open(self.path, "a")

    def write(self, record: dict) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl file, skipping lines an interrupted run cut short."""
    return [record for _, record in _parsed_lines(path)]


def _parsed_lines(path: str | Path) -> Iterator[tuple[str, object]]:
    """Each line of ``path`` that is valid JSON, with its parsed value."""
    for line in Path(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by an interrupted run
        yield line, record


class StepTimer:
    """Wall time of one step; on CUDA it waits for the queued kernels before reading."""

    def __init__(self, device: torch.device):
        self.device = device
        self._start = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start(self) -> None:
        self._sync()
        self._start = time.perf_counter()

    def stop(self) -> float:
        self._sync()
        return time.perf_counter() - self._start


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory so far: CUDA allocator peak on a GPU, process peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / (2**30 if sys.platform == "darwin" else 2**20)
