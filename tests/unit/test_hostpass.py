"""Tier 1 (no processes): the host's multi-tensor passes over CPU tensors (fingerprint.hostpass) and the cached
fast fingerprints (fingerprint.many.fast_cpu_fingerprints) give torch's answers, whatever moves (issue 62)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from distdebug.fingerprint import hostpass
from distdebug.fingerprint.hashing import fast_cpu_fingerprint
from distdebug.fingerprint.hostpass import CHUNK, HostPass
from distdebug.fingerprint.many import fast_cpu_fingerprints


def _model_tensors(n: int = 200, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    out = []
    for i in range(n):
        shape = (4, 4) if i % 2 == 0 else (4,)
        out.append(torch.randn(*shape, generator=g).to(dtype))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_any_nonfinite_finds_one_bad_value_anywhere_in_any_float_dtype(dtype, bad):
    ts = _model_tensors(dtype=dtype) + [torch.randn(CHUNK + 5).to(dtype)]  # small ones gathered, a large one alone
    p = HostPass()
    assert p.any_nonfinite(ts) is False
    for i, pos in ((0, 0), (77, 3), (199, 2), (200, CHUNK + 4)):
        with torch.no_grad():
            old = ts[i].view(-1)[pos].item()
            ts[i].view(-1)[pos] = bad
        assert p.any_nonfinite(ts) is True, (i, pos)  # the same addresses: read in place again
        assert hostpass.any_nonfinite(ts) is True  # a first look: gathered by address
        with torch.no_grad():
            ts[i].view(-1)[pos] = old
        assert p.any_nonfinite(ts) is False


def test_the_largest_finite_values_are_finite():
    ts = [torch.tensor([torch.finfo(d).max, -torch.finfo(d).max, torch.finfo(d).tiny], dtype=d)
          for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16)]
    assert hostpass.any_nonfinite(ts) is False


def test_norms_match_torchs_and_follow_tensors_that_move():
    p = HostPass()
    for _ in range(3):  # new tensors at new addresses every step, as gradients after zero_grad(set_to_none)
        ts = _model_tensors() + [torch.empty(0), torch.randn(CHUNK + 3)]
        want = torch.stack(torch._foreach_norm(ts, 2.0, dtype=torch.float32)).numpy()
        got = p.norms(ts)
        assert got is not None and got.dtype == np.float32
        np.testing.assert_allclose(got, want, rtol=1e-5)
        with torch.no_grad():
            ts[5][1] = float("nan")
        assert math.isnan(p.norms(ts)[5])
    h = [torch.randn(3).half(), torch.tensor([65504.0, 1.0]).half()]  # a float16 norm past float16's largest
    np.testing.assert_allclose(p.norms(h), torch.stack(torch._foreach_norm(h, 2.0, dtype=torch.float32)).numpy(),
                               rtol=1e-3)


def test_what_numpy_cannot_read_exactly_is_left_to_torch():
    p = HostPass()
    assert p.norms([torch.randn(3).bfloat16()]) is None  # no bfloat16 in numpy: torch's path
    assert p.any_nonfinite([torch.randn(4, 4).t()]) is None  # strided
    assert p.any_nonfinite([torch.arange(3)]) is None  # an integer tensor has no finiteness to check here
    assert p.any_nonfinite([]) is None
    assert p.any_nonfinite([torch.empty(3, device="meta")]) is None  # another device: its own fused kernels
    a = torch.randn(4)
    assert p.any_nonfinite([a]) is False and p.any_nonfinite([a, torch.randn(2, 2).t()]) is None


def test_cached_fingerprints_are_the_fingerprints_and_see_every_change():
    ts = _model_tensors(50)
    want = [fast_cpu_fingerprint(t) for t in ts]
    assert fast_cpu_fingerprints(ts) == want and fast_cpu_fingerprints(ts) == want  # built, then reused
    with torch.no_grad():
        ts[7][0] += 1  # in place: the same address, other bytes
    assert fast_cpu_fingerprints(ts) == [fast_cpu_fingerprint(t) for t in ts] != want
    ts[3] = torch.randn(4, 4)  # another tensor in the list
    assert fast_cpu_fingerprints(ts) == [fast_cpu_fingerprint(t) for t in ts]
    p = torch.nn.Parameter(torch.randn(8))
    before = fast_cpu_fingerprints([p])
    p.data = torch.randn(8)  # the same object, new storage
    assert fast_cpu_fingerprints([p]) == [fast_cpu_fingerprint(p)] != before


def test_many_chunks_share_one_bounded_buffer_and_every_chunk_is_read():
    """A model larger than a chunk: its small tensors are read a chunk at a time through one buffer of at most
    CHUNK elements (memory a pass holds is bounded whatever the model), and a NaN in the last chunk is found."""
    g = torch.Generator().manual_seed(1)
    ts = [torch.randn(50_000, generator=g) for _ in range(12)]  # 600,000 elements: three chunks
    p, q = HostPass(), HostPass()
    np.testing.assert_allclose(q.norms(ts), torch.stack(torch._foreach_norm(ts, 2.0)).numpy(), rtol=1e-5)
    assert p.any_nonfinite(ts) is False and p.any_nonfinite(ts) is False  # gathered, then in place
    with torch.no_grad():
        ts[11][49_999] = float("nan")
    assert p.any_nonfinite(ts) is True and math.isnan(q.norms(ts)[11])
    for hp in (p, q):
        assert hp._plan is not None
        assert len(hp._plan.groups[0][2]) == 3 and hp._plan.groups[0][1].size <= CHUNK


def test_host_copy_copies_every_byte_follows_moved_tensors_and_refuses_what_it_cannot_copy():
    from distdebug.fingerprint.hostpass import HostCopy

    src = [torch.randn(3, 4), torch.randn(7, dtype=torch.float64), torch.tensor([1, 2, 3]), torch.randn(0)]
    dst = [torch.empty_like(t) for t in src]
    hc = HostCopy()
    assert hc.copy(dst, src)
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    src[0].mul_(2)  # changed in place: the cached plan copies the new values
    assert hc.copy(dst, src) and torch.equal(dst[0], src[0])
    src[1] = torch.randn(7, dtype=torch.float64)  # moved: a new plan, the new tensor's bytes
    assert hc.copy(dst, src) and torch.equal(dst[1], src[1])
    assert not hc.copy(dst, [torch.randn(4, 3).t(), *src[1:]])  # strided: torch's path
    assert not hc.copy(dst, [torch.randn(3, 4, dtype=torch.float64), *src[1:]])  # another dtype
    assert not hc.copy(dst, [torch.randn(5), *src[1:]])  # another length
    assert not hc.copy(dst[:2], src)
    assert not hc.copy([torch.empty(3, device="meta")], [torch.empty(3, device="meta")])


def test_flat_clones_lie_end_to_end_and_are_filled_in_one_call_per_dtype():
    from distdebug.fingerprint.hostpass import HostCopy, flat_clones

    src = [torch.randn(3, 4), torch.randn(5, dtype=torch.float64), torch.randn(2), torch.randn(0), torch.randn(6)]
    dst = flat_clones(src)
    assert [d.shape for d in dst] == [s.shape for s in src] and [d.dtype for d in dst] == [s.dtype for s in src]
    assert all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    hc = HostCopy()
    for s in src:
        s.add_(1)
    assert hc.copy(dst, src) and all(torch.equal(d, s) for d, s in zip(dst, src, strict=True))
    assert len(hc._runs) == 1 and len(hc._single[0]) == 1  # float32 end to end; the float64 one alone
    strided = [torch.randn(4, 3).t()]
    assert not flat_clones(strided)[0].data_ptr() == strided[0].data_ptr()  # a plain clone, not a view of it


def test_gradients_take_their_parameters_seeds_and_give_the_fingerprints():
    """Gradients hashed with their parameters' seeds (``host_grad_fingerprints``) are their own fingerprints:
    after the parameters were hashed, without, and after a parameter was resized; a strided one is left."""
    from distdebug.fingerprint.many import host_fingerprints, host_grad_fingerprints

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))
    params = list(model.parameters())
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        model(torch.randn(5, 4)).sum().backward()
        grads = [p.grad for p in params]
        want = [fast_cpu_fingerprint(g) for g in grads]
        assert host_grad_fingerprints(grads, params) == want  # no plan of the parameters yet
        fast_cpu_fingerprints(params)
        assert host_grad_fingerprints(grads, params) == want  # their plan's seeds
    fast_cpu_fingerprints(params)
    params[0].data = torch.randn(6, 4)  # resized: the plan's seeds are not the gradient's
    params[0].grad = torch.randn(6, 4)
    grads = [p.grad for p in params]
    assert host_grad_fingerprints(grads, params) == [fast_cpu_fingerprint(g) for g in grads]
    params[0].grad = torch.randn(4, 6).t()  # a strided gradient: not read in place (the caller's general way)
    assert host_grad_fingerprints([p.grad for p in params], params) is None
    meta = [torch.empty(3, device="meta"), torch.empty(2, device="meta")]  # a device's: left to the device path
    assert host_grad_fingerprints(meta, meta) is None and host_fingerprints(meta) is None


def test_host_copy_into_its_own_list_reads_the_sources_every_time_and_another_list_afresh():
    """``owned``: the destinations' addresses are not read again for the same list (the capture's own copies), but
    the sources' are (a parameter that moved is copied from where it is now), and another list is read."""
    from distdebug.fingerprint.hostpass import HostCopy, flat_clones

    src = [torch.randn(3, 4), torch.randn(6)]
    dst = flat_clones(src)
    hc = HostCopy()
    assert hc.copy(dst, src, owned=True) and hc._dst is dst
    src[1] = torch.randn(6)  # moved
    assert hc.copy(dst, src, owned=True) and torch.equal(dst[1], src[1])
    other = flat_clones(src)
    src[0].add_(1)
    assert hc.copy(other, src, owned=True) and torch.equal(other[0], src[0]) and not torch.equal(dst[0], src[0])
    assert hc.copy(dst, src) and hc._dst is None and torch.equal(dst[0], src[0])  # not owned: nothing kept
