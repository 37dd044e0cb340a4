"""The TP engines: ``megatron`` (blocking collectives under autograd) and ``oases`` (two
sub-batches taking turns at every collective, cross-pass and fine-grained recompute),
the program runner, RNG streams, saved-tensor metering and the communication trace."""
