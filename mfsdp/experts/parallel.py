"""Expert parallelism applied to a model: the experts split over ``ep`` ranks, each expert's weights
FSDP-sharded over the data-parallel ranks that remain, tokens sent to their experts by all-to-all.

Meshes. The dense parameters keep the data-parallel mesh (``dp``, or ``(dp_replicate, dp_shard)``).
The experts use a second mesh over the same ranks, ``([dp_replicate,] ep_shard, ep)``, with ``ep``
innermost (neighbouring ranks, the fastest links, exchange tokens) and ``ep_shard = dp_shard / ep``.

Parameters. Each experts module's ``gate_up_proj`` and ``down_proj`` become DTensors split on dim 0
over ``ep`` (``Shard(0)``): rank ``r`` holds experts ``[r E/ep, (r+1) E/ep)``. ``fully_shard`` then
shards those local experts over ``ep_shard`` as it shards a tensor-parallel parameter's local tensor,
so the exposed DTensors describe the global ``[E, ...]`` tensors and DCP reshards them across ``ep``.

Gradients. A local expert's gradient already sums the contributions of every token of the ``ep``
group (the all-to-all's backward brings them home); the reduce-scatter over ``ep_shard`` averages
over ``dp_shard / ep`` ranks, so the experts' units divide by ``ep`` once more
(``CommunicationPolicy.gradient_divide_factor``): the average over every data-parallel rank, as the
dense parameters get. The dense path is untouched.
"""
