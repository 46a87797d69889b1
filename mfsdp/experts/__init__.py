"""Mixture-of-experts layers, one implementation for every route: stacked expert weights, the local
grouped computation, the token dispatch between expert-parallel ranks, and how experts are sharded.

* ``grouped``: a rank's experts over the tokens routed to them (one grouped GEMM, a loop fallback).
* ``dispatch``: which rank computes each (token, expert) pair and the all-to-all there and back.
* ``parallel``: expert parallelism applied to a model: the expert mesh, the experts' parameters split
  over ``ep`` as DTensors, their FSDP units over the ranks that remain, and the swapped forward.

An experts module here is any module with the interface of transformers 5's ``*Experts``
(Qwen3-MoE, Qwen2-MoE, Mixtral) and of ``mfsdp.models.moe.GroupedExperts``: parameters
``gate_up_proj`` ``[E, 2F, D]`` (gate rows first, then up) and ``down_proj`` ``[E, D, F]``, an
``act_fn``, ``num_experts``, and ``forward(hidden [T, D], top_k_index [T, K], top_k_weights [T, K])``
returning ``[T, D]``, each token's expert outputs mixed with its weights.
"""
