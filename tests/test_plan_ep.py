"""The memory plan of expert-parallel runs (``mfsdp.memory.experts``) against counts made by hand: the
experts' share of the model state per rank, their gathers, the dispatch buffers and the worst-case
routing the plan assumes and says; ``mfsdp plan --parallel.ep`` and its errors."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mfsdp.memory import estimate, mesh_for
from mfsdp.memory.experts import IMBALANCE, ExpertSplit, expert_levels, split_experts_for_plan
from mfsdp.memory.model_state import Levels, describe_units
from mfsdp.mixed_precision import MixedPrecisionPolicy
from mfsdp.models import build_model, get_config
from mfsdp.models.parallelize import sharding_units

pytestmark = [pytest.mark.timeout(240), pytest.mark.filterwarnings("ignore::UserWarning")]

REPO = Path(__file__).resolve().parents[1]
# moe-tiny narrowed: 2 blocks of 4 experts, top 2, dim 64, an expert 128 wide.
CFG = dataclasses.replace(get_config("moe-tiny"), n_layers=2, dim=64, ffn_dim=128)
BATCH, SEQ = 2, 32


def _params() -> tuple[int, int]:
    """(every expert's parameters, every other parameter) of ``CFG``."""
    with torch.device("meta"):
        model = build_model(CFG)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    return experts, sum(p.numel() for p in model.parameters()) - experts


def plan(placements: str, world: int, ep: int, **kw):
    return estimate(CFG, world_size=world, placements=placements, expert_parallel=ep, local_batch=BATCH,
                    seq_len=SEQ, compute_dtype=torch.float32, device="cpu", **kw)


def test_the_experts_share_of_the_model_state_is_split_over_ep_then_sharded():
    experts, dense = _params()
    assert experts == CFG.n_layers * CFG.num_experts * 3 * CFG.dim * CFG.ffn_dim
    # DDP replicates: every rank holds the dense weights and its ep rank's experts, fp32 main weights.
    for ep in (1, 2, 4):
        assert plan("ddp", 4, ep).component_max("main weights") == 4 * (dense + experts // ep), ep
    # ZeRO-3 over 4 ranks at ep 2: each experts unit holds E / ep experts, sharded dp_shard / ep = 2 ways;
    # a rank gathers only its ep rank's experts (these shapes shard without padding).
    with torch.device("meta"):
        model = build_model(CFG)
    units = sharding_units(model)
    model, units, ids, split = split_experts_for_plan(model, units, 2, 4, CFG.n_layers)
    placements, shape = mesh_for("zero3", 4)
    described = describe_units(model, units, MixedPrecisionPolicy(), Levels.of(placements, shape),
                               unit_levels=dict.fromkeys(ids, expert_levels(placements, shape, 2)))
    ours = [u for u in described if u.name.endswith(".experts")]
    per_layer = experts // CFG.n_layers
    assert len(ours) == CFG.n_layers and len(described) == 1 + 2 + 2 * CFG.n_layers  # root, embed, head
    assert all(u.total("main") == per_layer // 2 // 2 * 4 for u in ours)
    assert all(u.total("unsharded") == per_layer // 2 * 4 for u in ours)
    assert all(u.total("optimizer_numel") == per_layer // 4 for u in ours)
    assert sum(u.total("main") for u in described) == 4 * (dense + experts) // 4  # E / dp_shard experts a rank
    line = next(n for n in plan("zero3", 4, 2).notes if n.startswith("expert parallelism: model state"))
    state = CFG.n_layers * per_layer // 4 * (4 + 4 + 8) + sum(u.total("main_grad") - u.total("main") for u in ours)
    assert f"{state / 2**20:.2f} MiB for the experts (2 of each layer's 4, sharded 2 ways)" in line


def test_the_dispatch_buffers_and_the_worst_case_routing():
    tokens, k, e, d, f, b = BATCH * SEQ, CFG.top_k, CFG.num_experts, CFG.dim, CFG.ffn_dim, 4
    split = ExpertSplit(2, e, k, d, f, CFG.n_layers, CFG.n_layers)
    received = 2 * tokens * min(k, e // 2)  # every rank of the pair sends this rank all it can take
    assert split.received_rows(tokens) == received == 256
    assert split.dispatch_bytes(tokens, b) == 2 * (tokens * k + received) * d * b
    assert split.saved_extra_bytes(tokens, b) == (received - tokens * k) * (d + 4 * f) * b
    assert ExpertSplit(4, 8, 8, d, f, 1, 1).received_rows(tokens) == 4 * tokens * 2  # min(top_k, E / ep)
    # The plan saves that much more per MoE block until backward, and says what it assumed.
    one, two = plan("zero3", 4, 1), plan("zero3", 4, 2)
    extra = two.component_max("activations (saved)") - one.component_max("activations (saved)")
    assert extra == CFG.n_layers * split.saved_extra_bytes(tokens, b)
    assert two.component_max("activations (transient)") >= split.dispatch_bytes(tokens, b)
    assert "experts: 4 per layer, 2 on each of 2 ep ranks, each sharded 2 ways" in two.notes
    assert any(IMBALANCE in n for n in two.notes) and not any("expert parallelism" in n for n in one.notes)


def test_ep_that_cannot_split_is_refused():
    with pytest.raises(ValueError, match="must divide the model's 4 experts"):
        plan("zero3", 8, 8)
    with pytest.raises(ValueError, match="must divide the 3 data-parallel shard ranks"):
        plan("zero3", 3, 2)
    with pytest.raises(ValueError, match="this model has none"):
        estimate("tiny", world_size=2, expert_parallel=2, seq_len=32, device="cpu")


def _plan_cli(*args) -> subprocess.CompletedProcess:
    code = "import sys; from mfsdp.cli import main; sys.exit(main())"
    return subprocess.run([sys.executable, "-c", code, "plan", *args, "--out", "/dev/null/plan.png"],
                          capture_output=True, text=True, cwd=REPO, timeout=200)


def test_mfsdp_plan_with_ep_and_its_errors(tmp_path):
    small = ["--model.preset", "moe-tiny", "--data.seq_len", "32", "--train.out_dir", str(tmp_path)]
    bad = _plan_cli(*small, "--nproc-per-node", "3", "--parallel.ep", "2")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0, bad.stderr
    assert "--parallel.ep 2 must divide the 3 data-parallel shard ranks" in bad.stderr


@pytest.mark.slow
def test_mfsdp_plan_moe_1b_at_ep_2():
    """The issue's command; the default cells check the numbers on a narrow model."""
    run = subprocess.run([sys.executable, "-c", "import sys; from mfsdp.cli import main; sys.exit(main())",
                          "plan", "--model.preset", "moe-1b", "--nproc-per-node", "4", "--parallel.ep", "2",
                          "--out", str(Path("/tmp") / "mfsdp-plan-ep.png")], capture_output=True, text=True,
                         cwd=REPO, timeout=200)
    assert run.returncode == 0, run.stderr
    assert "experts: 8 per layer, 4 on each of 2 ep ranks, each sharded 2 ways" in run.stdout
    assert "worst-case routing assumed" in run.stdout


def test_a_hugging_face_moe_with_a_shared_expert():
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(
        "qwen2_moe", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48)
    e = estimate(config, world_size=4, expert_parallel=2, local_batch=1, seq_len=16, compute_dtype=torch.bfloat16,
                 device="cpu")
    assert ("experts: 4 per layer, 2 on each of 2 ep ranks, each sharded 2 ways; the shared expert "
            "(shared_expert) is sharded like the dense layers") in e.notes
    from mfsdp.hf.sharded import meta_model_from_config

    model = meta_model_from_config(config, dtype=torch.bfloat16)
    experts = sum(p.numel() for n, p in model.named_parameters() if n.endswith(("experts.gate_up_proj",
                                                                                "experts.down_proj")))
    assert experts == 2 * 4 * 3 * 64 * 32  # layers x experts x (gate, up, down) x dim x width
    everything = sum(p.numel() for p in model.parameters())
    ddp = estimate(config, world_size=4, placements="ddp", expert_parallel=2, local_batch=1, seq_len=16,
                   compute_dtype=torch.bfloat16, device="cpu")
    assert ddp.component_max("main weights") == 4 * (everything - experts // 2)
