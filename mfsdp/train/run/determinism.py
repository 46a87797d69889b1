"""``--parallel.deterministic true``: two runs with the same seeds, or a run and its resume, give
bit-identical losses.

Without it, two uninterrupted bf16 runs on H200s differ from step 2. What varies between runs on
CUDA, and what this mode does about each (torch 2.11 to 2.13):

* **Floating-point atomics.** Kernels that add into one address from many threads (``index_add_``
  in the mixture-of-experts combine, ``index_put_(accumulate=True)``, ``scatter_add_``, ...) add in
  the order the threads happen to run. ``torch.use_deterministic_algorithms(True)`` switches each
  such op to a deterministic implementation, and with ``warn_only=False`` an op that has none
  raises instead of silently differing. It also fills memory from ``torch.empty`` with NaN, so a
  read of uninitialised memory shows instead of varying.
* **Attention backward.** Flash attention (FA2) accumulates dQ across key blocks with atomics;
  torch passes ``deterministic=True`` to it when deterministic algorithms are on without
  ``warn_only``, and runs memory-efficient attention with one key split. cuDNN attention, torch's
  first choice on H100/H200 with cuDNN newer than 9.15, has no deterministic backward in torch:
  the SDPA dispatcher skips it in that mode (``check_cudnn_deterministic`` in sdp_utils.cpp), and
  it is switched off here as well (``enable_cudnn_sdp(False)``), so the choice does not hang on
  that check. Flash attention stays the fast path; no model change is needed.
* **cuBLAS.** Bitwise reproducible for one toolkit and GPU type, except when several streams
  share a handle's workspace pool: ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` gives each stream fixed
  buffers. Torch refuses cuBLAS calls in deterministic mode without it, and reads it once, at the
  first cuBLAS call, so it is set before anything touches the GPU.
* **cuDNN convolutions** (none in the built-in models; Hugging Face models may have them):
  ``cudnn.deterministic = True`` and ``cudnn.benchmark = False``, so no autotuned algorithm.
* **NCCL.** Ring and tree reductions add in a fixed order, and NCCL picks the algorithm and
  protocol from the collective, its size, the world size and the topology alone, so the same job
  shape reduces the same way every step and every run. ``NCCL_ALGO`` is left free: pinning Ring
  would cost the tree's bandwidth across nodes without making one job shape more repeatable.
  NVLink SHARP (NVLS) reduces in the NVSwitch and is not deterministic between calls
  (NVIDIA/nccl#1497, #2360), so ``NCCL_NVLS_ENABLE=0`` is set; it costs some all-reduce
  bandwidth on NVSwitch systems.

Not covered, and the caller's part: a resume must use the same world size, placements, GPU type
and torch/CUDA/NCCL versions (each changes the reduction order). Batches and initial weights are
already pure functions of the seeds and the step, and checkpoints carry each rank's random
generator states, so dropout (Hugging Face models) resumes where it stopped.

A known torch issue this mode cannot switch off: the embedding backward's fast kernel, used for
1025 to 3072 token ids per rank and microbatch, reuses shared memory across its batches of 1024
ids without a barrier (pytorch/pytorch#187687, #199569), so it may vary; the run warns then.
Below 1025 ids it runs one batch, above 3072 a sort-based kernel, both deterministic.
"""

from __future__ import annotations

import os

import torch

CUBLAS_ENV = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")  # the two values torch accepts
NVLS_ENV = "NCCL_NVLS_ENABLE"
# torch's embedding backward kernels: one with a shared-memory race for ids in this range.
EMBEDDING_RACE_IDS = range(1025, 3073)


def environment_problem(environ=os.environ) -> str | None:
    """What in the environment contradicts deterministic mode, or None; checked with the config,
    so the launcher names it before any worker starts."""
    cublas = environ.get(CUBLAS_ENV)
    if cublas is not None and cublas not in CUBLAS_DETERMINISTIC:
        return (f"--parallel.deterministic true needs {CUBLAS_ENV} unset, :4096:8 or :16:8 "
                f"(torch refuses cuBLAS calls in deterministic mode otherwise); it is {cublas!r}")
    nvls = environ.get(NVLS_ENV)
    if nvls is not None and nvls != "0":
        return (f"--parallel.deterministic true switches NVLink SHARP off ({NVLS_ENV}=0: NCCL's "
                f"NVLS reductions differ between calls); unset {NVLS_ENV}={nvls}")
    return None


def apply(cfg) -> None:
    """``enable`` when the run config asks for it (``--parallel.deterministic true``); rank 0
    prints the notes. ``mfsdp train`` calls it first thing after reading its config."""
    if not cfg.parallel.deterministic:
        return
    cuda = cfg.train.device == "cuda" or (cfg.train.device == "auto" and torch.cuda.is_available())
    notes = enable(cfg.data.seq_len * cfg.data.local_batch, cuda)
    if os.environ.get("RANK", "0") == "0":
        print("\n".join(notes), flush=True)


def enable(tokens_per_microbatch: int, cuda: bool) -> list[str]:
    """Switch this process to deterministic kernels and collectives; returns notes for the log.

    Call it before the first CUDA, cuBLAS or NCCL call: the environment variables are read once,
    when cuBLAS makes its first handle and when NCCL makes its communicators.
    """
    # cuBLAS sizes its per-stream workspaces from this at its first call, and torch caches its
    # check of the value then too: set later, it would change nothing and torch would refuse.
    os.environ.setdefault(CUBLAS_ENV, ":4096:8")
    os.environ.setdefault(NVLS_ENV, "0")  # read when NCCL creates a communicator
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    # cuDNN attention has no deterministic backward in torch; flash and memory-efficient attention
    # turn deterministic under use_deterministic_algorithms, and math always is.
    torch.backends.cuda.enable_cudnn_sdp(False)
    notes = [f"deterministic mode: deterministic torch algorithms, {CUBLAS_ENV}="
             f"{os.environ[CUBLAS_ENV]}, cuDNN attention off, {NVLS_ENV}={os.environ[NVLS_ENV]}"]
    if cuda and tokens_per_microbatch in EMBEDDING_RACE_IDS:
        notes.append(
            f"warning: {tokens_per_microbatch} tokens per rank and microbatch take torch's "
            "embedding-backward kernel with a shared-memory race (pytorch/pytorch#199569), which "
            "may make runs differ; use at most 1024 or more than 3072 (data.seq_len x "
            "data.local_batch)")
    return notes
