"""TEMPORARY: an expert-parallel dispatch by all-gather and all-reduce (exact, slow), until
mfsdp.experts.dispatch has its own; installed in the ranks with ``install()``."""

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dnn


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return torch.cat(out)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group))[dist.get_rank(ctx.group)], None


class _State:
    def __init__(self, order, pairs, num_tokens, top_k, group):
        self.order, self.pairs, self.num_tokens, self.top_k, self.group = order, pairs, num_tokens, top_k, group


def dispatch(x, expert_ids, num_experts, group=None):
    ep = dist.get_world_size(group)
    r = dist.get_rank(group)
    xs = _Gather.apply(x, group)
    ids = _Gather.apply(expert_ids, group)
    per = num_experts // ep
    flat = ids.flatten()
    mine = ((flat >= r * per) & (flat < (r + 1) * per)).nonzero().flatten()
    local = flat[mine] - r * per
    order = mine[local.argsort(stable=True)]
    counts = torch.bincount(local, minlength=per).tolist()
    return xs[order // ids.shape[1]], counts, _State(order, ids.shape[0], x.shape[0], ids.shape[1], group)


def combine(y, weights, state):
    ws = _Gather.apply(weights, state.group).flatten()[state.order].to(y.dtype)
    out = y.new_zeros(state.pairs, y.shape[-1]).index_add(0, state.order // state.top_k, y * ws[:, None])
    out = dnn.all_reduce(out, group=state.group)
    r = dist.get_rank(state.group)
    return out[r * state.num_tokens:(r + 1) * state.num_tokens]


def install():
    import mfsdp.experts.parallel as parallel
    parallel.dispatch, parallel.combine = dispatch, combine
