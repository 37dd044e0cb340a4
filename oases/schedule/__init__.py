"""Schedules: the block protocol and the engines that run a model's blocks."""
