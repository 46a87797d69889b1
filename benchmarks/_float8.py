"""``throughput.py --float8``: torchao float8 linears for the implementations that support them.

The linears (every ``nn.Linear`` but the head whose dimensions are multiples of 16, as torchtitan
picks them: ``mfsdp.float8.float8_filter``) are converted right after the model is built, before
activation checkpointing, compile and sharding, identically for every implementation. With
``--fp8-all-gather`` (tensorwise) the weights are also all-gathered in FP8: for mfsdp through
``mfsdp.float8`` (each block one unit, its float8 weights and norms in one gather; scales
precomputed after each optimizer step by ``precompute_fp8_scales``), for FSDP2 through torchao's
``Float8LinearConfig(enable_fsdp_float8_all_gather=True)`` and
``precompute_float8_dynamic_scale_for_fsdp`` after each step, its documented best setting.
``none`` (the unsharded ceiling) converts the same linears and gathers nothing.
"""

from __future__ import annotations

from _impls import Skip

FLOAT8_IMPLS = ("mfsdp", "mfsdp-db", "mfsdp-ub", "fsdp2", "none")


def float8_converter(args, impl):
    """``(convert, info)``: ``convert`` (for ``Ctx.convert``, which every builder applies to its fresh
    model before AC, compile and sharding) turns the model's linears into float8 and records their
    number in the dict ``info``; ``(None, {})`` without ``--float8``."""
    info: dict = {}
    if args.float8 == "none":
        return None, info
    if impl not in FLOAT8_IMPLS:
        raise Skip(f"--float8 is wired for {', '.join(FLOAT8_IMPLS)} only")
    from mfsdp import float8

    def convert(model):
        info["float8_linears"] = float8.convert_to_float8(
            model, args.float8, fp8_all_gather=args.fp8_all_gather and impl != "none", for_fsdp2=impl == "fsdp2")

    return convert, info


def precompute_scales_after_step(args, impl, built) -> str:
    """FP8 all-gather: each implementation's scale precomputation after every optimizer step (one
    all-reduce for all weights instead of one per gather); returns how, for the setup line."""
    if not args.fp8_all_gather or impl == "none":
        return ""
    if impl == "fsdp2":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        built.optimizer.register_step_post_hook(lambda *_: precompute_float8_dynamic_scale_for_fsdp(built.model))
        return "torchao enable_fsdp_float8_all_gather + precompute_float8_dynamic_scale_for_fsdp"
    from mfsdp import float8

    float8.precompute_fp8_scales_after(built.optimizer, built.model)
    return "mfsdp.float8 FP8 all-gather + precompute_fp8_scales"
