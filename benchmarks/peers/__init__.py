"""External peers of the benchmarks: the same models trained with other libraries."""
