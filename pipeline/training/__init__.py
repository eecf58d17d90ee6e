"""Training: the generic Lightning/DeepSpeed harness (config, strategy, resumable checkpoints, final
weights) in :mod:`pipeline.training.harness`, and the objectives that plug into it."""
