"""LoRA (mfsdp.transforms.lora): the config's errors, the targets by either naming, the forward and its
initialisation, compile and float8 bases, merging, and training under fully_shard on 2 gloo ranks
against an unsharded reference (fp32): same adapter gradients and AdamW steps, base untouched."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from mfsdp.transforms.lora import LoraTransform, init_adapters, lora_linears
from mfsdp.transforms.lora_export import adapter_state_dict, hf_target_modules, merged_state_dict, peft_key
from mfsdp.hf.names import hf_module_name, hf_weight_names
from mfsdp.models import Llama, get_config
from mfsdp.transforms import apply_transforms

TINY = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=64, max_seq_len=32)


def tiny(seed: int = 0, **overrides) -> Llama:
    torch.manual_seed(seed)
    model = Llama(get_config("tiny", **{**TINY, **overrides}))
    model.init_weights(seed=seed)
    return model


def randomize_b(model, seed: int = 1) -> None:
    """Nonzero B (PEFT's init has zeros), so that A gets gradients and the adapters change the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in lora_linears(model):
            m.lora_B.copy_(torch.randn(m.lora_B.shape, generator=g) * 0.1)


def test_bad_settings_are_one_line_naming_the_fix():
    for kwargs, message in [(dict(r=0), r"r=0 must be an integer >= 1; set --peft.lora_r"),
                            (dict(r=2.0), r"r=2.0 must be an integer"),
                            (dict(alpha=0), r"alpha=0 must be positive"),
                            (dict(dropout=1.0), r"dropout=1.0 must lie in \[0, 1\)"),
                            (dict(target_modules=("all-linear", "q_proj")), "mixes 'all-linear' with patterns"),
                            (dict(target_modules=()), "must be 'all-linear' or name patterns")]:
        with pytest.raises(ValueError, match=message) as err:
            LoraTransform(**kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"pattern 'qproj' matches no linear of the blocks; use 'all-linear' "
                       r"or patterns over the names down_proj, .*q_proj.*wq"):
        LoraTransform(target_modules="q_proj, qproj").apply(tiny())
    model = tiny()
    LoraTransform().apply(model)
    with pytest.raises(ValueError, match="already has LoRA adapters; apply LoRA once"):
        LoraTransform().apply(model)


def test_the_8b_line_on_the_meta_device():
    with torch.device("meta"):
        model = Llama(get_config("8b"))
    apply_transforms(model, [LoraTransform()])
    assert LoraTransform().describe(model) == "LoRA r 16, alpha 32, 7 linears × 32 blocks, 41.9M trainable of 8,072.2M"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * 7 * 32 and all(n.endswith(("lora_A", "lora_B")) for n in trainable)
    assert all(p.is_meta for p in model.parameters())
    wq = model.layers[0].attention.wq
    assert wq.lora_A.shape == (16, 4096) and wq.lora_B.shape == (4096, 16) and wq.lora_scale == 2.0
    assert LoraTransform(use_rslora=True).scale == 32 / 4


def test_lora_reads_its_names_off_the_one_table():
    """LoRA's linear names are the Hugging Face name table's (``mfsdp.hf.names``), not a second copy,
    and its two renamings are each other's inverse."""
    from mfsdp.hf.names import LINEARS, bundled_module_name

    derived = {(f"model.layers.0.{hf}.weight", f"layers.0.{ours}.weight") for ours, hf in LINEARS.items()}
    assert derived <= set(hf_weight_names(get_config("tiny"))) and len(LINEARS) == 7
    assert LINEARS["attention.wq"] == "self_attn.q_proj"
    assert all(bundled_module_name(hf_module_name(f"layers.3.{ours}")) == f"layers.3.{ours}" for ours in LINEARS)
    assert not hasattr(__import__("mfsdp.transforms.lora", fromlist=["x"]), "HF_BLOCK_NAMES")


def test_targets_by_either_naming_and_never_the_head():
    def targets(patterns):
        return [n for n, _ in LoraTransform(target_modules=patterns).targets(tiny())]

    assert targets("q_proj,down_proj") == targets("wq,w2") == targets("attention.wq,mlp.down_proj") == [
        "layers.0.attention.wq", "layers.0.feed_forward.w2", "layers.1.attention.wq", "layers.1.feed_forward.w2"]
    assert targets("all-linear") == targets("*_proj") == targets("layers.*")
    assert len(targets("all-linear")) == 14 and "output" not in targets("*")
    assert targets("layers.1.self_attn.*") == [f"layers.1.attention.w{x}" for x in "qkvo"]
    names = {ours: hf for hf, ours in hf_weight_names(tiny().cfg)}  # the loader's table agrees
    assert all(names[f"{n}.weight"] == f"{hf_module_name(n)}.weight" for n in targets("all-linear"))
    model = tiny()
    LoraTransform(target_modules="q_proj,v_proj").apply(model)
    assert hf_target_modules(model) == ["q_proj", "v_proj"]
    assert peft_key("layers.1.feed_forward.w3.lora_B") == "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"
    assert peft_key("model.layers.0.mlp.up_proj.lora_A") == "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"
    model = tiny()
    LoraTransform(target_modules="layers.0.*").apply(model)
    assert len(hf_target_modules(model)) == 7 and hf_target_modules(model)[0].startswith("model.layers.0.")
    assert LoraTransform().describe(model).startswith("LoRA r 16, alpha 32, 7 linears × 1 blocks, ")


def test_forward_is_the_base_plus_the_scaled_adapter():
    base, model = tiny(), tiny()
    lora = LoraTransform(r=4, alpha=8, use_rslora=True)
    lora.apply(model)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    assert torch.equal(model(tokens), base(tokens))  # B = 0: step 0 is the base model, bit for bit
    assert all(p.requires_grad == n.endswith(("lora_A", "lora_B")) for n, p in model.named_parameters())
    wq = model.layers[0].attention.wq
    assert wq.lora_A.abs().max() <= 1 / math.sqrt(32) and wq.lora_A.std() > 0.2 / math.sqrt(32)
    assert wq.weight.dtype == wq.lora_A.dtype == torch.float32
    randomize_b(model)
    x = torch.randn(3, 32)
    want = x @ wq.weight.T + (x @ wq.lora_A.T @ wq.lora_B.T) * (8 / math.sqrt(4))  # rsLoRA: alpha / sqrt(r)
    torch.testing.assert_close(wq(x), want, rtol=1e-6, atol=1e-6)
    with_dropout = tiny()
    LoraTransform(r=4, dropout=0.5).apply(with_dropout)
    randomize_b(with_dropout)
    with_dropout.train()
    assert not torch.equal(with_dropout(tokens), with_dropout(tokens))  # the adapter's input is dropped


def test_adapters_init_the_same_sharded_or_whole_and_by_seed():
    a, b = tiny(), tiny()
    LoraTransform().apply(a)
    LoraTransform().apply(b)
    init_adapters(a, seed=7)
    init_adapters(b, seed=7)
    assert all(torch.equal(x, y) for x, y in zip(adapter_state_dict(a).values(), adapter_state_dict(b).values()))
    init_adapters(b, seed=8)
    assert not torch.equal(a.layers[0].attention.wq.lora_A, b.layers[0].attention.wq.lora_A)
    assert all(not t.any() for n, t in adapter_state_dict(b).items() if n.endswith("lora_B"))


def test_a_compiled_block_has_no_graph_break():
    model = tiny()
    LoraTransform(dropout=0.1).apply(model)
    randomize_b(model)
    block = model.layers[0]
    compiled = torch.compile(block, fullgraph=True, backend="eager")  # a graph break raises
    x = torch.randn(2, 8, 32, requires_grad=True)
    cos, sin = model.rope_cos[:8], model.rope_sin[:8]
    torch.manual_seed(0)
    compiled(x, cos, sin).sum().backward()
    assert block.attention.wq.lora_A.grad is not None and block.attention.wq.weight.grad is None


def test_lora_wraps_a_float8_linear():
    pytest.importorskip("torchao")
    from torchao.float8.float8_linear import Float8Linear

    from mfsdp.transforms.float8_linear import convert_to_float8

    base = tiny()
    convert_to_float8(base, "tensorwise", fp8_all_gather=False)
    model = copy.deepcopy(base)
    LoraTransform(target_modules="wq,w2").apply(model)
    wq = model.layers[0].attention.wq
    assert isinstance(wq, Float8Linear) and type(wq).__name__ == "LoraFloat8Linear"
    assert wq.weight is model.layers[0].attention.wq.weight and not wq.weight.requires_grad
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    assert torch.equal(model(tokens), base(tokens))
    randomize_b(model)
    model(tokens).float().square().mean().backward()
    assert wq.lora_A.grad.abs().sum() > 0 and wq.weight.grad is None


def test_merged_weights_differ_by_rank_r_and_nowhere_else():
    model = tiny()
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    LoraTransform(r=3, target_modules="q_proj,w1,w2").apply(model)
    randomize_b(model)
    merged = merged_state_dict(model)
    assert set(merged) == set(base)
    targeted = {f"{n}.weight" for n, _ in lora_linears(model)}
    for name, weight in merged.items():
        if name in targeted:
            delta = (weight - base[name]).double()
            assert 1 <= torch.linalg.matrix_rank(delta, rtol=1e-4) <= 3, name  # fp32 rounding aside
        else:
            assert torch.equal(weight, base[name]), name
    plain = tiny()
    plain.load_state_dict(merged)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(plain(tokens), model(tokens), rtol=1e-5, atol=1e-5)


def _sharded_lora_parity(rank, ws, placements="zero3", steps=2):
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp.models.parallelize import ParallelizeConfig, parallelize

    model = tiny(seed=4)
    LoraTransform(r=4, alpha=8).apply(model)
    randomize_b(model)
    ref = copy.deepcopy(model)
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    parallelize(model, init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",)), ParallelizeConfig(placements=placements))
    for block in model.layers:  # a frozen base group, never reduced, beside the adapters' group
        assert [g.requires_grad for g in block.parameter_groups] == [False, True]
        assert not hasattr(block.parameter_groups[0], "reducer")
    params = [p for p in model.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    ref_optim = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    out = []
    for step in range(steps):
        tokens = torch.randint(0, 64, (4, 10), generator=torch.Generator().manual_seed(10 + step))
        for net, x in ((ref, tokens), (model, tokens.chunk(ws)[rank])):
            logits = net(x[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten()).backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.requires_grad}
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
        out.append(max(float((grads[n] - g).abs().max() / g.abs().max()) for n, g in ref_grads.items()))
        optim.step(), ref_optim.step(), optim.zero_grad(), ref_optim.zero_grad()
    now = {n: p.full_tensor() for n, p in model.named_parameters()}
    weights = max(float((now[n] - p).abs().max() / p.abs().max()) for n, p in ref.named_parameters() if p.requires_grad)
    unchanged = all(torch.equal(now[n], b) for n, b in base.items())
    return out, weights, unchanged


@pytest.mark.parametrize("placements", ["zero3", "ddp"])
def test_sharded_lora_matches_the_unsharded_reference(world, placements):
    grads, weights, unchanged = world(2).run(_sharded_lora_parity, placements=placements)[0]
    assert max(grads) < 1e-5 and weights < 1e-5, (grads, weights)
    assert unchanged


def _frozen_bf16_groups(rank, ws):
    from torch.distributed.device_mesh import init_device_mesh

    from mfsdp.models.parallelize import ParallelizeConfig, parallelize

    model = tiny().to(torch.bfloat16)
    LoraTransform().apply(model)
    parallelize(model, init_device_mesh("cpu", (ws,), mesh_dim_names=("dp",)), ParallelizeConfig())
    frozen, adapters = model.layers[0].parameter_groups
    model(torch.randint(0, 64, (1, 8))).float().sum().backward()
    return frozen.main.tensor.dtype, adapters.main.tensor.dtype, model.layers[0].attention.wq.lora_A.grad is not None


def test_a_frozen_bf16_base_keeps_no_fp32_copy(world):
    """The mixed-precision policy gives the adapters fp32 main weights and the frozen base none."""
    assert world(2).run(_frozen_bf16_groups)[0] == (torch.bfloat16, torch.float32, True)
