"""Document-masked attention on CUDA: flex_attention with a BlockMask (compiled), against SDPA with the
boolean mask; compiled blocks under mfsdp sharding with activation checkpointing; no recompiles
from one batch's documents to the next (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch

from mfsdp.models import build_model, get_config
from mfsdp.models.document_mask import document_mask

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600), pytest.mark.filterwarnings("ignore::UserWarning")]
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CFG = get_config("tiny", dim=256, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=512, vocab_size=512,
                 max_seq_len=512)


def _batch(seed: int, batch: int = 2, seq: int = 384, device="cuda"):
    """Tokens, restarting positions, document ids and labels: each row cut at random points."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, CFG.vocab_size, (batch, seq), generator=g)
    starts = torch.zeros(batch, seq, dtype=torch.bool)
    starts[:, 0] = True
    starts[torch.rand(batch, seq, generator=g) < 0.02] = True
    documents = starts.long().cumsum(1) - 1
    index = torch.arange(seq).expand(batch, seq)
    first = torch.zeros_like(index)
    for b in range(batch):
        first[b] = torch.cummax(torch.where(starts[b], index[b], 0), 0).values
    positions = index - first
    labels = torch.roll(tokens, -1, 1)
    labels[torch.roll(starts, -1, 1)] = -100
    labels[:, -1] = -100
    return [t.to(device) for t in (tokens, positions, documents, labels)]


def _rel(a, b) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def _grads(model, batch):
    tokens, positions, documents, labels = batch
    model.zero_grad(set_to_none=True)
    loss, count = model(tokens, positions=positions, document_ids=documents, labels=labels)
    (loss / count).backward()
    return float(loss), {n: p.grad.float().clone() for n, p in model.named_parameters()}


@requires_cuda
def test_flex_matches_the_boolean_mask_on_cuda():
    torch.manual_seed(0)
    model = build_model(CFG, device="cuda")
    model.init_weights(seed=0)
    batch = _batch(1)
    assert not isinstance(document_mask(batch[2]), torch.Tensor)  # auto: a BlockMask on CUDA
    flex_loss, flex = _grads(model, batch)
    model.document_mask_backend = "sdpa"
    sdpa_loss, sdpa = _grads(model, batch)
    assert abs(flex_loss - sdpa_loss) < 1e-4 * abs(sdpa_loss)
    for n in sdpa:
        assert _rel(flex[n], sdpa[n]) < 1e-3, n


@requires_cuda
def test_compiled_blocks_with_flex_do_not_recompile_across_batches():
    torch.compiler.reset()
    eager = build_model(CFG, device="cuda")
    eager.init_weights(seed=0)
    compiled = build_model(CFG, device="cuda")
    compiled.init_weights(seed=0)
    compiled.set_activation_checkpointing(True)
    for block in compiled.layers:
        block.compile()
    for i, seed in enumerate((1, 2, 3)):
        batch = _batch(seed)
        with torch.compiler.set_stance("fail_on_recompile" if i else "default"):
            loss, grads = _grads(compiled, batch)
        ref_loss, ref = _grads(eager, batch)
        assert abs(loss - ref_loss) < 1e-4 * abs(ref_loss)
        for n in ref:
            assert _rel(grads[n], ref[n]) < 1e-3, n


def sharded_compiled_step(rank, ws, bf16):
    """zero3 over the NCCL world, compiled blocks, activation checkpointing, bf16 compute with fp32
    main weights: the loss and gradients of the unsharded eager model, two batches."""
    import mfsdp
    from mfsdp.mesh import build_mesh
    from mfsdp.models.parallelize import ParallelizeConfig, parallelize

    dtype = torch.bfloat16 if bf16 else torch.float32
    policy = mfsdp.MixedPrecisionPolicy(main_params_dtype=torch.float32) if bf16 else None
    torch.compiler.reset()
    ref = build_model(CFG, device="cuda")
    ref.init_weights(seed=0)
    with torch.device("meta"):
        model = build_model(CFG, dtype=dtype)
    parallelize(model, build_mesh("cuda", ws), ParallelizeConfig(
        "zero3", mixed_precision=policy, activation_checkpointing=True, compile=True))
    model.to_empty(device="cuda")
    model.init_weights(buffer_device="cuda", seed=0)
    out = []
    for seed in (1, 2):
        batch = _batch(seed)
        model.zero_grad(set_to_none=True)
        loss, count = model(*batch[:1], positions=batch[1], document_ids=batch[2], labels=batch[3])
        (loss / count).backward()
        grads = {n: p.grad.full_tensor().float() for n, p in model.named_parameters()}
        ref_loss, ref_grads = _grads(ref, batch)
        out.append((abs(float(loss) - ref_loss) / abs(ref_loss),
                    max(_rel(grads[n], ref_grads[n]) for n in ref_grads)))
    return out


@requires_cuda
@pytest.mark.parametrize("bf16", [False, True])
def test_sharded_compiled_document_training_step(cuda_world, bf16):
    for loss_err, grad_err in cuda_world.run(sharded_compiled_step, bf16=bf16)[0]:
        assert loss_err < (2e-2 if bf16 else 1e-4) and grad_err < (1e-1 if bf16 else 1e-3), (loss_err, grad_err)
