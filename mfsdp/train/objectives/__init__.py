"""Training objectives: what a step minimises and what a run reports of it.

An objective runs the model's forward passes on one microbatch (as many as it needs: say a second
one without gradients, for a reference) and returns the summed loss, the count this batch adds to
what the loss is normalised by, and its named metric sums. The step divides the sums by the global
batch's count, which the objective reads from the sampler before the step (``global_count``), so
the gradient is the whole batch's mean whatever the microbatch and rank split. The step, the
validation pass (``val_`` before each name), the log lines, metrics.jsonl, TensorBoard, W&B and the
plot show whatever names ``metrics`` lists; a new objective is a new file here and a branch in
``objective_for``."""

from __future__ import annotations

from mfsdp.train.objectives.base import Objective
from mfsdp.train.objectives.causal_lm import CausalLM
from mfsdp.train.objectives.preference import Preference


def objective_for(cfg, data) -> Objective:
    """The objective a run of ``cfg`` trains on ``data`` with: preference tuning on a file of pairs
    (``cfg.pairs`` says so where the file is not open: the memory planner)."""
    return Preference(cfg, data) if cfg.pairs or (data is not None and data.is_pairs) else CausalLM()
