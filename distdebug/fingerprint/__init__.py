"""Tensor fingerprints: which tensor differs across ranks, runs, or a checkpoint round trip."""
