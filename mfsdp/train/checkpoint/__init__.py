"""Checkpoints of ``mfsdp train`` that an interrupted save can never corrupt: ``storage`` (the
layout, saving, finding and loading), ``meta`` (``meta.json``, its only reader and writer) and
``async_save`` (staging and background writes)."""

from mfsdp.train.checkpoint.async_save import Checkpointer, HostStager, async_staging_problem, staging_bytes
from mfsdp.train.checkpoint.meta import META, CheckpointMeta, checkpoint_bytes
from mfsdp.train.checkpoint.storage import (LATEST, check_compatible, complete_checkpoints, damage, find_latest,
                                            find_resumable, is_complete, load_checkpoint, save_checkpoint)
from mfsdp.train.command.errors import CheckpointError

