"""``python -m mfsdp.train``: the entry point torchrun launches on every rank."""

import os
import sys
import traceback

from mfsdp.train.command.main import main

try:
    code = main()
except BaseException:  # noqa: BLE001: printed here, then the process leaves at once
    # torch's @record has written the error file; print the traceback and leave without the
    # slow interpreter teardown, so the rank that found the fault (a collective timeout, say)
    # is reported before the peers it leaves behind fail on its closed connections.
    traceback.print_exc()
    code = 1
# Leave without interpreter finalization: everything the run writes is closed or flushed by now
# (metrics, TensorBoard, checkpoints, plots) and the process group is destroyed, but tearing down
# torch's C++ state at exit could abort a loaded gloo worker after a successful run ("terminate
# called without an active exception", 3 of 6 CPU runs under load), turning success into a failure.
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
