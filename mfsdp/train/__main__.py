"""``python -m mfsdp.train``: the entry point torchrun launches on every rank."""

import sys

from mfsdp.train.loop import main

sys.exit(main())
