"""Data parallelism: gradient buckets, ZeRO-1/2/3 ownership and the parameter store,
the tied-table and per-block replica gradient sums."""
