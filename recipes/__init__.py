"""Real small training programs: the targets of attach tests, fault replays and benchmarks.

Each runs unchanged under ``torchrun`` or ``distdebug attach``: CPU with gloo, or one GPU per rank
with nccl. None imports distdebug: they stand for the user's own code.
"""
