"""Bytes each rank sends per training step, by collective, for a Qwen3-30B-A3B-shaped model: without
expert parallelism and at ep 2, 4 and 8, counted from the collectives actually issued.

The real width does not fit a CPU machine, so the counts come from a narrow slice of the model: the real
expert count, top-k and tokens per rank, narrower hidden, head and expert widths, a small vocabulary and
fewer layers. A world of ``--ranks`` gloo processes builds the slice as a transformers 5
``Qwen3MoeForCausalLM``, shards it as ``mfsdp train --model.hf`` does (zero3, one unit per decoder layer,
then the root; with EP, ``mfsdp.experts.parallel.apply_expert_parallel`` first), runs a warm-up step and
then one counted step (forward, backward, AdamW step; no gradient clipping) while ``_ep_counter`` records
every collective's bytes (its docstring states the convention: ring bytes leaving one rank). The closed
form (``formula``) must agree with the counts within 1% for every collective, else the script fails; the
tables at the real width then come from that formula, on 8 and on 64 GPUs.

Routing: each router's scores are computed (and get gradients), but each token's experts are a uniform
random choice of ``top_k`` distinct experts (``uniform_router``). The counted check uses the copies that
actually left each rank; the real-width tables use the expectation, a fraction ``(E - E/ep) / E`` of each
rank's ``tokens * top_k`` copies leaving it. Dtypes as ``mfsdp train`` on CUDA by default: bf16 compute,
fp32 main weights, weights gathered and gradients reduced in bf16, tokens sent in bf16.

    python benchmarks/ep_bytes.py                   # 8 ranks, 4,096 tokens a rank, ep 1 2 4 8 (~2 min)
    python benchmarks/ep_bytes.py --ac              # the same with activation checkpointing
    python benchmarks/ep_bytes.py --ranks 4 --eps 1 2 4 --layers 1 --tokens 256 --experts 16 --top-k 2
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import math
import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all")
TOLERANCE = 0.01
SOURCES = ("Qwen3-30B-A3B: 48 layers, 32 query / 4 key-value heads, 128 experts, 8 active, 30.5B parameters "
           "(model card, e.g. https://hf-p-cfw.fyan.top/gtkunit/Qwen3-30B-A3B-6.0bpw-h6-exl2); hidden 2048, "
           "head_dim (kv-channels) 128, moe_intermediate 768, vocab 151936, untied embeddings, q/k norms "
           "(github.com/zyzshishui/slime scripts/models/qwen3-30B-A3B.sh); llama.cpp reads 30.53B parameters "
           "from the published weights (github.com/ollama/ollama issue 10458), as `Shape.parameters` counts.")


@dataclasses.dataclass(frozen=True)
class Shape:
    """A Qwen3-MoE shape: every MoE layer has ``experts`` SwiGLU experts of width ``moe_intermediate``."""

    layers: int
    hidden: int
    experts: int
    top_k: int
    moe_intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    def __post_init__(self) -> None:
        if self.top_k > self.experts or min(dataclasses.astuple(self)) < 1:
            raise ValueError(f"bad shape {self}: every size positive and top_k <= experts")

    def layer_params(self) -> list:
        """A decoder layer's dense parameters: q, k, v, o, the q/k norms, the two RMSNorms, the router."""
        d, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [(q, d), (kv, d), (kv, d), (d, q), (self.head_dim,), (self.head_dim,), (d,), (d,),
                (self.experts, d)]

    def expert_params(self, ep: int = 1) -> list:
        """One MoE layer's stacked experts (``gate_up_proj``, ``down_proj``) held by one of ``ep`` ranks."""
        e, f, d = self.experts // ep, self.moe_intermediate, self.hidden
        return [(e, 2 * f, d), (e, d, f)]

    def root_params(self) -> list:
        """The embedding, the output head (untied) and the final norm."""
        return [(self.vocab, self.hidden), (self.vocab, self.hidden), (self.hidden,)]

    def parameters(self) -> int:
        per_layer = self.layer_params() + self.expert_params()
        return self.layers * sum(map(math.prod, per_layer)) + sum(map(math.prod, self.root_params()))


QWEN3_30B_A3B = Shape(layers=48, hidden=2048, experts=128, top_k=8, moe_intermediate=768, heads=32, kv_heads=4,
                      head_dim=128, vocab=151936)


@dataclasses.dataclass(frozen=True)
class Dtypes:
    """Bytes per element: gathered weights, reduced gradients, tokens sent to experts."""

    params: int = 2
    grads: int = 2
    tokens: int = 2


# ------------------------------------------------------------------------------------------- formula
USAGE_COLUMNS = 4  # mfsdp's reducer sends int64 usage rows beside each gradient: a count per parameter + 4 tags


def unit_bytes(shapes: list, ways: int, gathers: int, dtypes: Dtypes) -> tuple[float, float]:
    """(all-gather, reduce-scatter) bytes one rank sends per step for one FSDP unit of parameters
    ``shapes`` sharded ``ways`` ways (dim 0 padded to a multiple of ``ways``), gathered ``gathers``
    times; its gradients reduce-scattered once, with the reducer's int64 usage rows."""
    if ways == 1:
        return 0.0, 0.0
    out = (ways - 1) / ways
    full = sum(-(-s[0] // ways) * ways * math.prod(s[1:]) for s in shapes)
    usage = 8 * ways * (len(shapes) + USAGE_COLUMNS)
    return out * gathers * full * dtypes.params, out * (full * dtypes.grads + usage)


def formula(shape: Shape, ranks: int, ep: int, tokens: int, dtypes: Dtypes = Dtypes(),
            leaving: float | None = None, ac: bool = False) -> dict:
    """Bytes one rank sends per step (zero3, one microbatch), by collective.

    Units: each decoder layer (dense parameters, with its experts when ``ep == 1``), sharded over all
    ``ranks``, gathered in forward and again in backward; the root (embedding, head, final norm) gathered
    once (it stays gathered from forward to backward); with ``ep > 1`` each layer's experts, ``1 / ep`` of
    them per rank, sharded over the ``ranks / ep`` ranks that remain, gathered twice. Each unit's
    gradients are reduce-scattered once. Per MoE layer with ``ep > 1``: the counts all-to-all
    (``experts`` int64, in forward) and four token all-to-alls (dispatch and combine, forward and
    backward), each sending the ``leaving`` fraction of the ``tokens * top_k`` copies (default: the
    uniform-routing expectation ``(ep - 1) / ep``) at ``hidden`` elements each. With activation
    checkpointing (``ac``) the recomputed forward sends the counts and both forward all-to-alls again.
    """
    if ranks % ep or shape.experts % ep:
        raise ValueError(f"ep {ep} must divide the {ranks} ranks and the {shape.experts} experts")
    layer = shape.layer_params() + (shape.expert_params() if ep == 1 else [])
    units = [(layer, ranks, 2)] * shape.layers + [(shape.root_params(), ranks, 1)]
    if ep > 1:
        units += [(shape.expert_params(ep), ranks // ep, 2)] * shape.layers
    sums = [sum(col) for col in zip(*(unit_bytes(s, ways, gathers, dtypes) for s, ways, gathers in units))]
    leaving = (ep - 1) / ep if leaving is None else leaving
    copies = shape.layers * tokens * shape.top_k * leaving
    counts = shape.layers * 8 * shape.experts * (ep - 1) / ep
    passes = 6 if ac else 4
    return {"all-gather": sums[0], "reduce-scatter": sums[1], "all-reduce": 0.0,
            "all-to-all": passes * copies * shape.hidden * dtypes.tokens + counts * (2 if ac else 1)}


# ------------------------------------------------------------------------------ the counted slice
def hf_config(shape: Shape, seq: int):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=shape.vocab, hidden_size=shape.hidden, num_hidden_layers=shape.layers,
                          num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                          head_dim=shape.head_dim, moe_intermediate_size=shape.moe_intermediate,
                          num_experts=shape.experts, num_experts_per_tok=shape.top_k, norm_topk_prob=True,
                          tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[],
                          max_position_embeddings=seq, use_cache=False)


class UniformRouting:
    """Replaces each router's choice of experts by a uniform random one (the scores still weight the
    chosen experts, so the router trains), and counts the copies that leave this rank under ``ep``."""

    def __init__(self, ep: int, ep_rank: int) -> None:
        self.ep, self.ep_rank = ep, ep_rank
        self.copies = self.leaving = 0

    def forward(self, router, hidden: torch.Tensor):
        hidden = hidden.reshape(-1, router.hidden_dim)
        logits = torch.nn.functional.linear(hidden, router.weight)
        probs = logits.float().softmax(dim=-1)
        # The default generator: activation checkpointing restores its state, so a recomputation chooses alike.
        chosen = torch.rand(hidden.shape[0], router.num_experts).topk(router.top_k).indices
        weights = probs.gather(1, chosen)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        self.copies += chosen.numel()  # a recomputation counts the same choice again: the fraction holds
        self.leaving += int((chosen // (router.num_experts // self.ep) != self.ep_rank).sum())
        return logits, weights.to(logits.dtype), chosen

    def install(self, model) -> None:
        import functools

        for module in model.modules():
            if type(module).__name__ == "Qwen3MoeTopKRouter":
                module.forward = functools.partial(self.forward, module)


def shard_model(model, ep: int, ac: bool = False):
    """Shard ``model`` as ``mfsdp train --model.hf`` does on a 1-D data-parallel mesh (zero3, each decoder
    layer a unit, then the root), with its experts split over ``ep`` ranks first when ``ep > 1``; ``ac``:
    each layer's forward recomputed in backward, as ``--parallel.activation_checkpointing`` does.

    The expert-parallel path is the library's own (``mfsdp.experts.parallel.apply_expert_parallel``)."""
    import mfsdp
    from mfsdp.experts.parallel import apply_expert_parallel
    from mfsdp.manager.core_options import checkpoint_forward, resolve_unit_modules
    from mfsdp.mesh import build_mesh, resolve_placements

    mesh, placements = build_mesh("cpu"), resolve_placements("zero3")
    policy = mfsdp.MixedPrecisionPolicy()  # fp32 main weights, bf16 gradients (the compute dtype)
    if ep > 1:
        apply_expert_parallel(model, mesh, placements, ep, mixed_precision=policy)
    for _, unit in resolve_unit_modules(model):
        if ac:
            checkpoint_forward(unit)
        mfsdp.fully_shard(unit, mesh, placements, mixed_precision_policy=policy)
    mfsdp.fully_shard(model, mesh, placements, mixed_precision_policy=policy)
    return model


def count_one(shape: Shape, ep: int, tokens: int, seq: int, counter, rank: int, ac: bool) -> dict:
    """Build, shard and train the slice at ``ep`` for a warm-up step and a counted one; this rank's
    counts and the fraction of its token copies that left it."""
    import mfsdp
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(hf_config(shape, seq)).to(torch.bfloat16)
    routing = UniformRouting(ep, rank % ep)
    routing.install(model)
    shard_model(model, ep, ac)
    torch.manual_seed(1000 + rank)  # each rank routes its own way
    optimizer = mfsdp.fully_shard_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    ids = torch.randint(shape.vocab, (tokens // seq, seq), generator=torch.Generator().manual_seed(rank))
    for counted in (False, True):
        routing.copies = routing.leaving = 0
        counter.sent.clear(), counter.calls.clear()
        with counter.counting() if counted else contextlib.nullcontext():
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {"sent": dict(counter.sent), "calls": dict(counter.calls), "leaving": routing.leaving / routing.copies,
            "dispatch": dispatch_name(ep)}


def dispatch_name(ep: int) -> str:
    return "none (no EP)" if ep == 1 else "mfsdp.experts.dispatch"


def worker(rank: int, ranks: int, init_file: str, shape: Shape, tokens: int, seq: int, eps: list, ac: bool,
           out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    import torch.distributed as dist
    import transformers

    from _ep_counter import ByteCounter

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed.nn.functional's deprecation
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks,
                            timeout=datetime.timedelta(seconds=600))
    counter = ByteCounter()
    with counter.patch():
        results = {ep: count_one(shape, ep, tokens, seq, counter, rank, ac) for ep in eps}
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def count_slice(shape: Shape, ranks: int, tokens: int, eps: list, ac: bool = False) -> dict:
    """{ep: {"sent": {kind: mean bytes over ranks}, "calls": rank 0's, "leaving": the mean fraction}}."""
    import torch.multiprocessing as mp

    seq = min(tokens, 1024)
    if tokens % seq:
        raise SystemExit(f"--tokens {tokens} must be a multiple of {seq}")
    with tempfile.TemporaryDirectory() as out:
        # Forked after the heavy imports, so that the ranks do not import torch, transformers and mfsdp anew.
        import _ep_counter, mfsdp.experts.parallel, transformers.models.qwen3_moe.modeling_qwen3_moe  # noqa: F401
        mp.start_processes(worker, args=(ranks, os.path.join(out, "init"), shape, tokens, seq, eps, ac, out),
                           nprocs=ranks, start_method="fork")
        per_rank = [torch.load(os.path.join(out, f"rank{r}.pt")) for r in range(ranks)]
    counted = {}
    for ep in eps:
        rows = [r[ep] for r in per_rank]
        kinds = sorted({k for row in rows for k in row["sent"]})
        counted[ep] = {"sent": {k: sum(row["sent"].get(k, 0) for row in rows) / ranks for k in kinds},
                       "calls": rows[0]["calls"], "leaving": sum(row["leaving"] for row in rows) / ranks,
                       "dispatch": rows[0]["dispatch"]}
    return counted


# ------------------------------------------------------------------------------------------ report
def label(ep: int) -> str:
    return "no EP" if ep == 1 else f"ep {ep}"


def check_rows(shape: Shape, ranks: int, tokens: int, counted: dict, ac: bool) -> tuple[list, float]:
    """Markdown rows of the counted slice beside the formula, and the largest relative difference."""
    rows, worst = [], 0.0
    for ep, c in counted.items():
        f = formula(shape, ranks, ep, tokens, Dtypes(), leaving=c["leaving"], ac=ac)
        diffs = [abs(c["sent"].get(k, 0) - f[k]) / f[k] if f[k] else float(c["sent"].get(k, 0) > 0) for k in KINDS]
        worst = max([worst, *diffs])
        extra = {k: v for k, v in c["sent"].items() if k not in KINDS and v}
        cells = [f"{c['sent'].get(k, 0) / 1e6:.4f} / {f[k] / 1e6:.4f}" for k in KINDS]
        rows.append(f"| {label(ep)} | {' | '.join(cells)} | {max(diffs):.3%} | {c['leaving']:.4f} ({(ep - 1) / ep:.4f})"
                    f" | {sum(c['calls'].values())} |" + (f" uncounted kinds: {extra}" if extra else ""))
    return rows, worst


def real_rows(ranks: int, tokens: int, eps: list, ac: bool) -> list:
    rows, base = [], None
    for ep in eps:
        f = formula(QWEN3_30B_A3B, ranks, ep, tokens, ac=ac)
        total = sum(f.values())
        base = base or total
        cells = " | ".join(f"{f[k] / 1e9:.2f}" for k in KINDS)
        rows.append(f"| {ranks} | {label(ep)} ({QWEN3_30B_A3B.experts // ep} experts a rank, sharded {ranks // ep} "
                    f"ways) | {cells} | {total / 1e9:.2f} | {total / base:.2f}x |")
    return rows


def report(args, shape: Shape, counted: dict) -> bool:
    head = "| " + " | ".join(KINDS) + " |"
    print("# Bytes each rank sends per training step, by collective: Qwen3-30B-A3B shape, zero3, "
          f"activation checkpointing {'on' if args.ac else 'off'}\n")
    print(f"Sources: {SOURCES}\n")
    print("Convention: ring bytes leaving one rank; over a group of n ranks: all-gather and reduce-scatter "
          "(n-1)/n of the full buffer, all-reduce 2(n-1)/n, all-to-all the rows sent to other ranks. Routing: "
          "uniform random top-k (each copy leaves its rank with probability (E - E/ep)/E = (ep-1)/ep).\n")
    print(f"## Counted on a slice: {args.ranks} gloo ranks, {args.tokens:,} tokens a rank, {shape}\n")
    dispatch = sorted({c["dispatch"] for ep, c in counted.items() if ep > 1})
    print("MB counted / MB by the formula (given the copies that left each rank), mean over ranks. "
          f"Token dispatch counted: {', '.join(dispatch) or 'none'}.\n")
    print(f"| config {head} worst diff | copies leaving (expected) | collectives |")
    print("|---" * 8 + "|")
    rows, worst = check_rows(shape, args.ranks, args.tokens, counted, args.ac)
    print("\n".join(rows))
    ok = worst <= TOLERANCE
    print(f"\nformula vs counts: largest difference {worst:.3%} ({'within' if ok else 'OVER'} {TOLERANCE:.0%})\n")
    print(f"## Real width, from the formula: {QWEN3_30B_A3B.parameters() / 1e9:.2f}B parameters, "
          f"{args.tokens:,} tokens a GPU, bf16 weights, gradients and tokens (GB = 1e9 bytes)\n")
    print(f"| GPUs | config {head} total | / no EP |")
    print("|---" * 8 + "|")
    for ranks in (8, 64):
        print("\n".join(real_rows(ranks, args.tokens, [e for e in (1, 2, 4, 8, 64) if ranks % e == 0], args.ac)))
    ratio = [sum(formula(QWEN3_30B_A3B, 8, ep, args.tokens, ac=args.ac).values()) for ep in (8, 1)]
    print(f"\nep 8 / no ep: {ratio[0] / ratio[1]:.2f}x")
    return ok


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--ranks", type=int, default=8, help="gloo processes (default 8)")
    p.add_argument("--tokens", type=int, default=4096, help="tokens a rank per step (default 4096)")
    p.add_argument("--eps", type=int, nargs="+", default=[1, 2, 4, 8], help="ep sizes to count (1: no EP)")
    p.add_argument("--layers", type=int, default=2, help="slice: decoder layers (default 2)")
    p.add_argument("--hidden", type=int, default=64, help="slice: hidden width (default 64)")
    p.add_argument("--experts", type=int, default=QWEN3_30B_A3B.experts)
    p.add_argument("--top-k", type=int, default=QWEN3_30B_A3B.top_k)
    p.add_argument("--moe-intermediate", type=int, default=32, help="slice: expert width (default 32)")
    p.add_argument("--heads", type=int, default=8, help="slice: query heads (default 8; 4 key-value heads)")
    p.add_argument("--head-dim", type=int, default=16, help="slice: head_dim (default 16)")
    p.add_argument("--vocab", type=int, default=1024, help="slice: vocabulary (default 1024)")
    p.add_argument("--ac", action="store_true", help="activation checkpointing on every decoder layer")
    args = p.parse_args(argv)
    for ep in args.eps:
        if args.ranks % ep or args.experts % ep:
            p.error(f"--eps {ep} must divide --ranks {args.ranks} and --experts {args.experts}")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    shape = Shape(layers=args.layers, hidden=args.hidden, experts=args.experts, top_k=args.top_k,
                  moe_intermediate=args.moe_intermediate, heads=args.heads, kv_heads=max(1, args.heads // 2),
                  head_dim=args.head_dim, vocab=args.vocab)
    counted = count_slice(shape, args.ranks, args.tokens, args.eps, args.ac)
    return 0 if report(args, shape, counted) else 1


if __name__ == "__main__":
    sys.exit(main())
