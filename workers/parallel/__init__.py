"""Tensor parallelism: split sizes, the replica group, the step-plan channel and the ranks."""
