"""What a run trains: the sharded model and optimizer, LoRA's saved state, the samplers of the data."""
