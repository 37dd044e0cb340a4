"""Pipelines: per-stage action lists and their simulator, the runner that executes them
with the TP engine of each stage, and cross-mesh resharding between stages."""
