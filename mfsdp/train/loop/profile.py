"""``--train.profile_step N``: one step of ``mfsdp train`` under torch.profiler, written as a chrome
trace per rank and, on rank 0, a breakdown of that step by phase.

The phases are the profiler ranges the step opens (``mfsdp.train.data``, ``.forward_backward``,
``.optimizer_step``, ``mfsdp.model.head_and_loss``, the runtime's ``mfsdp::`` ranges): a kernel
belongs to the range that launched it, so compiled kernels of different phases stay apart, which a
grouping by kernel name cannot do. Profiling costs host time in the profiled step only; its record
in metrics.jsonl is marked ``profiled``, so medians can leave it out.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

PREFIXES = ("mfsdp.", "mfsdp::")
"""The names of mfsdp's own ranges: what the breakdown lists."""


class StepProfiler:
    """Profiles step ``step`` (0: none) and writes OUT_DIR/profile/step_N_rankR.json and, on rank 0,
    step_N_breakdown.md."""

    def __init__(self, out_dir: Path, step: int, rank: int, device: torch.device, log):
        self.step, self.rank, self.device, self.log = step, rank, device, log
        self.dir = Path(out_dir) / "profile"

    def around(self, step: int):
        """A context that profiles ``step`` if it is the chosen one, else does nothing."""
        return self._profiled(step) if step == self.step else contextlib.nullcontext()

    @contextlib.contextmanager
    def _profiled(self, step: int):
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            yield
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the step's kernels, not only their launches
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"step_{step}_rank{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        if self.rank == 0:
            breakdown = self.dir / f"step_{step}_breakdown.md"
            breakdown.write_text(breakdown_table(prof.key_averages(), step, self.device.type))
            self.log(f"profiled step {step}: {trace} (one per rank), by phase in {breakdown}")


def breakdown_table(averages, step: int, device_type: str) -> str:
    """A markdown table of mfsdp's ranges in a profile's ``key_averages()``: calls, host ms and, on
    CUDA, the device ms of the kernels each launched; the largest device (on CPU: host) time first."""
    rows = []
    for e in averages:
        if e.key.startswith(PREFIXES):
            device_us = getattr(e, "device_time_total", None)
            if device_us is None:  # torch before the device_* names
                device_us = getattr(e, "cuda_time_total", 0)
            rows.append((e.key, e.count, e.cpu_time_total / 1e3, device_us / 1e3))
    rows.sort(key=lambda r: -(r[3] if device_type == "cuda" else r[2]))
    cuda = device_type == "cuda"
    lines = [f"# step {step}: time by phase ({device_type})", "",
             "Ranges nest (forward_backward holds the model's), so the rows do not add up.", "",
             "| range | calls | host ms |" + (" device ms |" if cuda else ""),
             "|---|---|---|" + ("---|" if cuda else "")]
    lines += [f"| {name} | {count} | {host:.2f} |" + (f" {dev:.2f} |" if cuda else "")
              for name, count, host, dev in rows]
    return "\n".join(lines) + "\n"
