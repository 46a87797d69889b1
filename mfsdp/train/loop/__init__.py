"""The training loop: steps, the learning rate, validation, profiling."""
