"""What the benchmarks share: the emulated cluster, machine facts, the rounds driver and its report."""
