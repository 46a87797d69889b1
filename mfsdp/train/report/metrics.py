"""Per-step measurements: metrics.jsonl and TensorBoard, step timing without host stalls, and
peak memory."""

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


def scalars(record: dict) -> dict:
    """The numbers of a metrics record but its step: what TensorBoard and W&B plot."""
    return {key: value for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}


class TensorBoardLog:
    """The numeric fields of each metrics record as TensorBoard scalars under ``log_dir``
    (rank 0 only): the same names as metrics.jsonl, so the two never disagree."""

    def __init__(self, log_dir: Path, enabled: bool, purge_step: int | None = None):
        self._writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package
            # purge_step drops events after the resumed step, as MetricsLog drops lines.
            self._writer = SummaryWriter(str(log_dir), purge_step=purge_step)

    def write(self, record: dict) -> None:
        if self._writer is None:
            return
        for key, value in scalars(record).items():
            self._writer.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class StepReadout:
    """Per-step scalars and step times read off the device one step late, without a stall.

    ``push(step, values)`` is called once the step's work is queued. On CUDA it copies
    ``values`` into pinned host memory on the current stream (non-blocking) and records an
    event, then returns the previous step's values, waiting only for the previous step's
    event. By then the current step is already queued, so the GPU never idles while the
    host reads. Step times come from CUDA events between consecutive step ends, so no
    ``synchronize`` is needed either. On CPU the same protocol runs on wall-clock time.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._cuda = device.type == "cuda"
        self._pending: tuple | None = None
        self._buffers: list[torch.Tensor] = []
        self._flip = 0
        self._last_mark = self.mark()

    def mark(self):
        """A point in time on the device's stream (wall-clock on CPU): a step's end, for ``push``."""
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def restart_clock(self) -> None:
        """Start timing the next step from now (after a checkpoint save, say)."""
        self._last_mark = self.mark()

    def push(self, step: int, values: torch.Tensor, extra: dict, end=None) -> tuple | None:
        """Queue ``step``'s 1-D ``values``, the step having ended at ``end`` (a ``mark``; default
        now); return the previous step's ``(step, values as floats, seconds, extra)``, or None on the
        first call."""
        end = self.mark() if end is None else end
        if self._cuda:
            if not self._buffers or self._buffers[0].shape != values.shape:
                # Two buffers: step s writes one while step s-1's is still to be read.
                self._buffers = [torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
                                 for _ in range(2)]
            host = self._buffers[self._flip]
            self._flip ^= 1
            host.copy_(values.detach(), non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host, ready = values.detach(), None
        previous, self._pending = self._pending, (step, host, ready, self._last_mark, end, extra)
        self._last_mark = end
        return self._read(previous)

    def flush(self) -> tuple | None:
        """The last pushed step's values (waits for them); None if already read."""
        previous, self._pending = self._pending, None
        return self._read(previous)

    def _read(self, pending: tuple | None) -> tuple | None:
        if pending is None:
            return None
        step, host, ready, start, end, extra = pending
        if ready is not None:
            ready.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            seconds = end - start
        return step, host.tolist(), seconds, extra


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory so far: CUDA allocator peak on a GPU, process peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / (2**30 if sys.platform == "darwin" else 2**20)
