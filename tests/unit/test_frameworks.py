"""Tier 1 (pure): reading a framework's loss division off the call stack; where a save or load goes;
matching a load to a buffer's save by content."""

from __future__ import annotations

import io
import sys

from distdebug.detectors.checkpoint_roundtrip import closest, target
from distdebug.runtime import frameworks

# Stand-ins for the frameworks' own backward methods: a frame is told by its function's and module's names.
ACCELERATE = '''
class Accelerator:
    def __init__(self, steps, kind="MULTI_CPU"):
        self.gradient_accumulation_steps, self.distributed_type = steps, kind

    def backward(self, loss):
        return inner()
'''
LIGHTNING = '''
class Strategy:
    def __init__(self, module):
        self.lightning_module = module

    def backward(self, loss):
        return inner()
'''


def _module(name: str, source: str):
    namespace = {"__name__": name, "inner": lambda: frameworks.loss_factor(sys._getframe(1))}
    exec(compile(source, f"<{name}>", "exec"), namespace)  # noqa: S102 - a fixed stand-in, above
    return namespace


def test_the_factor_is_read_from_accelerates_and_lightnings_backward():
    acc = _module("accelerate.accelerator", ACCELERATE)["Accelerator"]
    assert acc(4).backward(None) == 4.0
    assert acc(1).backward(None) == 1.0
    assert acc(4, "DistributedType.DEEPSPEED").backward(None) == 1.0  # handed to DeepSpeed undivided
    strategy = _module("lightning.pytorch.strategies.ddp", LIGHTNING)["Strategy"]

    class Trainer:
        accumulate_grad_batches = 3

    class Module:
        automatic_optimization = True
        _trainer = Trainer()

    assert strategy(Module()).backward(None) == 3.0
    Module.automatic_optimization = False  # manual_backward(loss): the user's own loss
    assert strategy(Module()).backward(None) == 1.0
    # The same names in another module are not a framework's; nor is a frame further up than MAX_DEPTH.
    assert _module("mytrainer", ACCELERATE)["Accelerator"](4).backward(None) == 1.0
    assert frameworks.loss_factor(sys._getframe()) == 1.0


def test_where_a_save_or_load_goes():
    assert target("ckpt.pt") == "ckpt.pt"
    assert target(io.BytesIO()) is None  # a buffer: no path

    class FsspecLocal:  # fsspec's LocalFileOpener keeps the path it opened
        path = "/tmp/x/last.ckpt"

    assert target(FsspecLocal()) == "/tmp/x/last.ckpt"
    with open(__file__, "rb") as f:
        assert target(f) == __file__


def test_a_load_is_matched_to_the_buffer_save_it_differs_least_from():
    saves = [{"fps": {f"t{i}": i for i in range(20)}, "step": 4, "rank": 0},
             {"fps": {f"t{i}": i + 100 for i in range(20)}, "step": 8, "rank": 0}]
    same = {f"t{i}": i + 100 for i in range(20)}
    assert closest(saves, same) == (saves[1], [])  # the step-8 save, exactly
    corrupted = dict(same, t3=-1)
    assert closest(saves, corrupted) == (saves[1], ["t3"])
    unrelated = {f"t{i}": i + 1000 for i in range(20)}
    assert closest(saves, unrelated) is None  # every tensor differs: another checkpoint, not a corruption
    assert closest(saves, {"other": 1}) is None  # other names: never compared
    three = dict(same, t1=-1, t2=-1, t3=-1)
    assert closest(saves, three) is None  # more than a tenth differ


def test_deepspeeds_division_of_the_loss_is_read_from_its_backwards_arguments_and_the_raw_loss_divided():
    """engine.backward(loss) divides the loss by the accumulation steps unless scale_wrt_gas is False: read from
    the call's arguments by name, through a decorator that hides the signature (DeepSpeed's instrument_w_nvtx), for
    both of DeepSpeed's signatures (the older one's engine attribute overrides the argument). The clock's raw sum
    (what parity compares) is the divided loss; the loss the script sees is not divided."""
    import inspect
    import sys

    import torch

    from distdebug.runtime.clock import StepClock
    from distdebug.runtime.engine_hooks import _defined, _engine_division

    def hidden(func):  # as DeepSpeed's instrument_w_nvtx: no functools.wraps
        def wrapped_fn(*args, **kwargs):
            return func(*args, **kwargs)
        return wrapped_fn

    class New:
        scale_wrt_gas = None

        def gradient_accumulation_steps(self):
            return 4

        @hidden
        def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
            return loss

    class Old(New):
        @hidden
        def backward(self, loss, allreduce_gradients=True, release_loss=False, retain_graph=False,
                     scale_wrt_gas=True):
            return loss

    new, old = New(), Old()
    sig_new, sig_old = (inspect.signature(_defined(e.backward)) for e in (new, old))
    assert [_engine_division(new, sig_new, 1.0, args, kwargs) for args, kwargs in
            (((), {}), ((False, False), {}), ((), {"scale_wrt_gas": False}), ((True, True), {}))] == [4, 1, 1, 4]
    assert [_engine_division(old, sig_old, 1.0, args, kwargs) for args, kwargs in
            (((True, False), {}), ((True, False, False, False), {}))] == [4, 1]
    old.scale_wrt_gas = False  # the older engine's own setting wins over the argument
    assert _engine_division(old, sig_old, 1.0, (), {}) == 1
    clock = StepClock()
    clock.keep_raw = True
    for _ in range(2):
        clock.add_loss(torch.tensor(3.0), sys._getframe(), 2.0)  # a frame of no framework's backward
    assert float(clock.raw_sum) == 3.0 and float(clock.loss_sum) == 6.0
