"""What a run reports: the first lines, each step's record, metrics.jsonl, TensorBoard, W&B, the plot, the epilogue."""
