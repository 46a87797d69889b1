"""The `mfsdp train` worker of tests/test_async_checkpoint.py (started by torchrun, or ``steered_run``
in a test world's processes): the real training loop, whose background checkpoint writes go through
a DCP ``FileSystemWriter`` the test steers by environment variables.

``HOLD_WRITE=S:T``  the write of checkpoint step_S waits, inside ``write_data``, until metrics.jsonl
                    (rank 0's, one step late) holds step T, then writes; it gives up after 120 s.
                    Each rank records what happened in OUT_DIR/hold_rank<R>.json.
``KILL_WRITE=S:R``  rank R writes its files of step_S, then SIGKILLs itself before the write returns.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from mfsdp.train.checkpoint import async_save
from mfsdp.train.command.main import main
from mfsdp.train.report.metrics import read_metrics

GIVE_UP_S = 120.0


def _spec(name: str) -> tuple[int, int] | None:
    value = os.environ.get(name)
    return tuple(map(int, value.split(":"))) if value else None


class SteeredWriter(dcp.FileSystemWriter):
    def __init__(self, path):
        super().__init__(path)
        self.temp = Path(path)  # OUT_DIR/checkpoints/.tmp-step_N
        self.step = int(self.temp.name.rsplit("_", 1)[1])
        self.out_dir = self.temp.parent.parent
        self.rank = dist.get_rank()

    def write_data(self, plan, planner):
        hold, kill = _spec("HOLD_WRITE"), _spec("KILL_WRITE")
        if hold and hold[0] == self.step:
            self._hold_until(hold[1])
        result = super().write_data(plan, planner)
        if kill and kill == (self.step, self.rank):
            result.wait()  # this rank's shards are on disk; the save as a whole is not finished
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    def _hold_until(self, target: int) -> None:
        metrics = self.out_dir / "metrics.jsonl"
        start, logged = time.monotonic(), 0
        while time.monotonic() - start < GIVE_UP_S:
            logged = max((r["step"] for r in read_metrics(metrics)), default=0) if metrics.is_file() else 0
            if logged >= target:
                break
            time.sleep(0.05)
        record = {"save": self.step, "steps_logged_while_held": logged, "gave_up": logged < target}
        (self.out_dir / f"hold_rank{self.rank}.json").write_text(json.dumps(record))


def steered_run(rank, world_size, argv, env):
    """A world case: the run of ``argv`` with its writes steered by ``env`` (HOLD_WRITE, KILL_WRITE);
    returns run_trainer's (rank 0: the records and what it printed)."""
    from test_eval_loss import run_trainer

    writer = async_save._storage_writer
    os.environ.update(env)
    async_save._storage_writer = SteeredWriter
    try:
        return run_trainer(rank, world_size, argv, stdout=True)
    finally:
        async_save._storage_writer = writer
        for name in env:
            del os.environ[name]


if __name__ == "__main__":
    async_save._storage_writer = SteeredWriter
    sys.exit(main(sys.argv[1:]))
