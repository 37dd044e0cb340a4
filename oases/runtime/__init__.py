"""Training runtime: optimizer, LR schedule, data, DP reduction, checkpoints, metrics."""
