"""The ``mfsdp train`` command: config, data, loop, checkpoints and plots.

Run ``python -m mfsdp.train --help`` for the flags, or launch several processes with
``torchrun --nproc-per-node N -m mfsdp.train``.
"""
