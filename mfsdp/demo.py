"""``make demo``: train the tiny model on two CPU processes, then show what it learned.

Launches ``torchrun --standalone --nproc-per-node 2 -m mfsdp.train`` as a child process
(through ``python -m torch.distributed.run``, so the torchrun of this interpreter's torch
is used). Extra arguments are passed to the trainer, e.g.
``python -m mfsdp.demo --train.steps 50``.
"""

from __future__ import annotations

import os
import subprocess
import sys

DEMO_ARGS = ["--train.device", "cpu", "--model.preset", "tiny", "--data.path", "stdlib",
             "--train.out_dir", "runs/demo"]


def command(extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", "2", "-m", "mfsdp.train", *DEMO_ARGS, *extra]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    env = dict(os.environ)
    # Two processes share the machine's cores; one thread each avoids oversubscription
    # (torchrun would set this anyway, with a warning).
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = command(argv)
    print("running:", " ".join(cmd[1:]), flush=True)
    try:
        return subprocess.call(cmd, env=env)
    except KeyboardInterrupt:  # the children got the same Ctrl-C, save and exit
        return 130


if __name__ == "__main__":
    sys.exit(main())
