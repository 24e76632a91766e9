"""Tier 1 (pure): numeric sketches of tensors (distdebug/fingerprint/sketch.py), the distance between two runs'
tensors from a few hundred numbers each (issue 50's first brick)."""

from __future__ import annotations

import statistics

import torch

from distdebug.fingerprint.sketch import distance, mix, relative_error, sketch, sketch_block

MASK = (1 << 64) - 1


def splitmix(i: int, seed: int) -> int:
    """The reference: splitmix64's finaliser in unsigned 64-bit Python integers."""
    z = (i * 0x9E3779B97F4A7C15 + seed * 0x2545F4914F6CDD1D) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def test_the_mix_on_int64_tensors_is_splitmix64_bit_for_bit():
    # torch's int64 products wrap and its right shift copies the sign: the mix must still be the unsigned one,
    # or two devices (or a shard and the whole) would hash an element differently
    index = torch.tensor([0, 1, 2, 12345, 2**31 - 1, 2**40 + 7, 2**62 + 3], dtype=torch.int64)
    for seed in (0, 1, 2**33 + 5):
        got = [v & MASK for v in mix(index, seed).tolist()]
        assert got == [splitmix(i, seed) for i in index.tolist()]


def test_the_sketch_is_linear_and_a_shards_sketches_sum_to_the_whole(monkeypatch):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 96, generator=g)
    b = a + 1e-3 * torch.randn(64, 96, generator=g)
    # the difference taken in float64 (in fp32 it would be rounded before it is sketched)
    assert torch.allclose(sketch(a) - sketch(b), sketch(a.double() - b.double()), rtol=0, atol=1e-12)
    # Shard(0), uneven: each rank sketches its rows at their global offset; the sum is the whole's sketch
    rows = [a[:20], a[20:21], a[21:]]
    offsets = [0, 20 * 96, 21 * 96]
    shards = sum(sketch(r, offset=o) for r, o in zip(rows, offsets, strict=True))
    assert torch.allclose(shards, sketch(a), rtol=0, atol=1e-9)
    # Shard(1) (tensor parallel's columns): blocks at a column offset, strided in the whole (sketch_block)
    halves = [(a[:, :40], (0, 0)), (a[:, 40:], (0, 40))]
    assert torch.allclose(sum(sketch_block(v, o, tuple(a.shape)) for v, o in halves), sketch(a), rtol=0, atol=1e-9)
    # the same blocks with the indices made in chunks of 7 elements, and a 3-D tensor cut in both its last
    # dimensions
    import distdebug.fingerprint.sketch as sketch_module

    monkeypatch.setattr(sketch_module, "CHUNK", 7)
    assert torch.allclose(sketch_block(a[:, :40], (0, 0), tuple(a.shape)) + sketch_block(a[:, 40:], (0, 40),
                                                                                        tuple(a.shape)),
                          sketch(a), rtol=0, atol=1e-9)
    c = a.reshape(4, 32, 48)[:, 2:, :16]  # a view, not contiguous: its values are what count
    parts = [((0, 0, 0), c[:, :10, :5]), ((0, 0, 5), c[:, :10, 5:]), ((0, 10, 0), c[:, 10:, :5]),
             ((0, 10, 5), c[:, 10:, 5:])]
    assert torch.allclose(sum(sketch_block(v, o, tuple(c.shape)) for o, v in parts), sketch(c), rtol=0, atol=1e-9)
    # the same elements at other indices are another tensor (a transposed or shifted shard is not the whole)
    assert not torch.allclose(sketch(a, offset=96), sketch(a), atol=1e-3)


def test_the_distance_is_unbiased_within_its_stated_error_even_for_a_benign_difference():
    # A difference of 1e-6 of the tensor's norm (reduction-order noise in fp32) is measured relative to itself:
    # float64 sums, and a linear sketch, so the tensor's own size cancels. Over 200 seeds the estimates' spread
    # is the stated relative error.
    g = torch.Generator().manual_seed(1)
    x = torch.randn(50_000, generator=g)
    d = 1e-6 * x.norm() * torch.nn.functional.normalize(torch.randn(50_000, generator=g), dim=0)
    y = x + d
    true = float((y.double() - x.double()).norm())
    ratios = [distance(sketch(x, seed=s), sketch(y, seed=s)) / true for s in range(200)]
    err = relative_error()
    assert abs(statistics.fmean(ratios) - 1) < 2 * err / 200 ** 0.5 + 0.01
    assert 0.5 * err < statistics.stdev(ratios) < 1.5 * err
    assert max(abs(r - 1) for r in ratios) < 5 * err
    # a difference concentrated in one element is measured as well as a spread one
    spike = x.clone()
    spike[123] += 1e-3
    assert abs(distance(sketch(x, seed=3), sketch(spike, seed=3)) / 1e-3 - 1) < 5 * err


def test_low_precision_and_empty_tensors_are_sketched():
    t = torch.arange(1000, dtype=torch.float32).reshape(10, 100) / 1000
    assert torch.allclose(sketch(t.to(torch.bfloat16)), sketch(t.to(torch.bfloat16).float()), rtol=0, atol=1e-12)
    assert sketch(torch.empty(0)).abs().sum() == 0 and sketch(torch.empty(0)).shape == (128,)
