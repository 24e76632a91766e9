"""What a detector is given: the rank's identity, its context, and one step's event.

These types sit below the runtime and the detectors alike (the session builds them, detectors read
them), so neither package imports the other for them. torch is named for types only: importing
this module stays cheap.
"""

from __future__ import annotations

import os
import socket
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from distdebug.findings import Finding

if TYPE_CHECKING:
    from torch import nn
    from torch.optim import Optimizer


def _ignore(*args: Any, **kwargs: Any) -> None:
    """The default of a context callable before the session fills it in (tests build bare contexts)."""


class ExchangeChannel(Protocol):
    """One detector's channel on the rank's cross-rank exchange (runtime.exchange.Channel)."""

    @property
    def world(self) -> int: ...

    def post(self, payload: Any, callback: Callable[[list[Any]], None],
             prepare: Callable[[Any], Any] | None = None) -> bool: ...

    def gather(self, payload: Any) -> list[Any]: ...


class SharedExchange(Protocol):
    """The rank's one cross-rank exchange (runtime.exchange.Exchange), as detectors see it."""

    world: int

    def channel(self, tag: str) -> ExchangeChannel: ...


@dataclass(kw_only=True)
class RankIdentity:
    """Where this process sits in the job; read from torchrun's environment variables."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node: int
    attempt: int
    host: str
    pid: int

    @classmethod
    def from_env(cls) -> RankIdentity:
        env = os.environ
        return cls(
            rank=int(env.get("RANK", 0)),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            world_size=int(env.get("WORLD_SIZE", 1)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
            node=int(env.get("GROUP_RANK", 0)),
            attempt=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
            host=socket.gethostname(),
            pid=os.getpid(),
        )


@dataclass
class RankContext:
    """What detectors may read: identity, live models and optimizers, and what discovery said.

    Models and optimizers are held weakly: the harness never keeps the user's objects alive. A
    script that builds a fresh DDP wrapper or optimizer every step, or deletes and rebuilds its
    model, behaves as under torchrun (a DDP wrapper kept alive keeps its reducer's hooks on the
    parameters). ``models`` and ``optimizers`` are the ones still alive.
    """

    identity: RankIdentity
    run_dir: Path | None
    rank_dir: Path | None
    model_refs: list[weakref.ref[nn.Module]] = field(default_factory=list)
    optimizer_refs: list[weakref.ref[Optimizer]] = field(default_factory=list)
    discovery: dict[str, Any] = field(default_factory=dict)
    report: Callable[[Finding], None] = _ignore
    """Report a finding from any thread (detectors' background work)."""
    patch: Callable[[Any, str, Any], None] = _ignore
    """patch(obj, name, replacement): replace an attribute until the session ends (restored then)."""
    emit: Callable[..., None] = _ignore
    """emit(kind, **fields): append one record of that kind to this rank's event stream."""
    finding_listeners: list[Callable[[Finding], None]] = field(default_factory=list)
    """Callables(Finding) told of every finding this rank reports (from any thread)."""
    backward_t: float | None = None
    """time.monotonic() of the step's first backward call that reduces gradients (the arrival at the gradient
    reduction; under DDP's no_sync() accumulation the syncing one)."""
    exchange: SharedExchange | None = None
    """The rank's one background exchange with its peers (None without peers, or before discovery):
    detectors take a channel of it (runtime.exchange.ExchangeUser.open_exchange)."""
    communication_observers: list[Callable[[Any, Any], None]] = field(default_factory=list)
    """Callables(input, output) told of each of torch's functional collectives (what DTensor and TP
    layers communicate with), on the training thread; they must not read device values."""
    end_of_backward: list[Callable[[], None]] = field(default_factory=list)
    """Callables() run once per backward, inside autograd's engine when the graph is done and before the
    callbacks queued after the backward began (DDP's reducer queues its finalisation then, which copies
    the reduced gradients back into ``.grad``): with DDP's default ``gradient_as_bucket_view=False`` the
    gradients they see are this rank's own, before the reduction. Device work only, no reads."""
    local_grad_norms: dict[int, Any] = field(default_factory=dict)
    """id(DDP model) -> its ``runtime.localgrads.LocalGradNorms``: one fused norm of the local gradients a
    step, shared by the detectors that read them (``runtime.localgrads.local_grad_norms``)."""
    layout: Any = None
    """The rank's parallel layout (``runtime.layout.Layout``), found at the end of discovery: which ranks
    every cross-rank check compares (data-parallel group, each tensor's replica group). None before."""
    raw_collectives: dict[str, Any] = field(default_factory=dict)
    """torch.distributed functions as they were before the session wrapped them: the harness's own
    collectives use these, so they are neither counted nor tracked as the training's."""

    @property
    def rank(self) -> int:
        return self.identity.rank

    @property
    def models(self) -> list[nn.Module]:
        return [m for m in (r() for r in self.model_refs) if m is not None]

    @models.setter
    def models(self, value: list[nn.Module]) -> None:
        self.model_refs = [weakref.ref(m) for m in value]

    @property
    def optimizers(self) -> list[Optimizer]:
        return [o for o in (r() for r in self.optimizer_refs) if o is not None]

    @optimizers.setter
    def optimizers(self, value: list[Optimizer]) -> None:
        self.optimizer_refs = [weakref.ref(o) for o in value]

    def add_optimizer(self, opt: Any) -> None:
        """Note an optimizer (weakly), once."""
        if not any(r() is opt for r in self.optimizer_refs):
            self.optimizer_refs.append(weakref.ref(opt))


@dataclass(frozen=True, kw_only=True)
class StepEvent:
    """What one rank saw in one step. Times in seconds; loss is the mean of the step's backward losses."""

    rank: int
    step: int
    loss: float | None
    step_time_s: float
    backward_calls: int
    collectives: int
    backward_total: int = 0
    """Backward calls since the start: equal across ranks in lockstep training, even when a rank
    skips optimizer.step (which the step number alone cannot show)."""
    skipped: bool = False
    """A loss scaler (torch.amp.GradScaler, DeepSpeed fp16) skipped this step's update: its gradients
    were not finite, which the scaler handles by design (the parameters did not change, the scale
    goes down). Not a NaN of the training's."""
    loss_scale: float | None = None
    """The loss scale this step's backward ran with (AMP), when a scaler is in use."""
    readout: dict[str, dict[str, Any]] = field(default_factory=dict)
    """detector name -> {key: value}: what each detector's ``probe`` asked for, read to the host in
    the step's one device-to-host transfer (runtime.readout)."""
