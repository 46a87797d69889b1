"""``make demo``: train the tiny model on two CPU processes, then show what it learned.

Runs ``mfsdp train --nproc-per-node 2`` with the demo's settings, in this process: the
launcher checks the config, then starts the two workers. Extra arguments are passed on,
e.g. ``python -m mfsdp.demo --train.steps 50``.
"""

from __future__ import annotations

import sys

DEMO_ARGS = ["--train.device", "cpu", "--model.preset", "tiny", "--data.path", "stdlib",
             "--train.out_dir", "runs/demo", "--train.overwrite", "true"]
"""``--train.overwrite true``: each ``make demo`` starts the demo's run afresh (its directory holds
only what an earlier demo wrote there)."""


def main(argv: list[str] | None = None) -> int:
    from mfsdp.cli import main as cli_main

    args = ["train", "--nproc-per-node", "2", *DEMO_ARGS, *(sys.argv[1:] if argv is None else argv)]
    print("running: mfsdp", " ".join(args), flush=True)
    return cli_main(args)


if __name__ == "__main__":
    sys.exit(main())
