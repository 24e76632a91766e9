"""InitSeed: initial parameters that differ across ranks, and unseeded randomness.

- The initial parameters are fingerprinted before anything can make them equal: DDP's constructor
  (which broadcasts rank 0's parameters) is watched from the script's first line, and any other
  model is fingerprinted at its first forward. At the end of step 1 the ranks exchange these
  fingerprints once, in the background (``runtime.exchange``).
  - Different, and nothing broadcast them (a hand-written loop, a plain module): the replicas
    differ from step 0 and will never agree: an error naming the tensors.
  - Different before DDP broadcast them: training is fine (DDP made them equal); ranks seeded
    apart on purpose are a common idiom: no finding.
- ``torch.manual_seed`` never called before the first step: torch's generator was seeded from the
  OS, so no two runs are alike (info, with every rank's seed when they differ).

``--deterministic`` (attach) seeds Python's, numpy's and torch's generators with 0 and turns on
``torch.use_deterministic_algorithms`` before the script runs (see ``launch.bootstrap``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from distdebug.cards.init_seed import CARD
from distdebug.context import RankContext, StepEvent
from distdebug.detectors.base import Detector
from distdebug.findings import Finding, Severity
from distdebug.fingerprint.compare import compare, with_group
from distdebug.fingerprint.pending import PendingFingerprints, finish_read, rows_to_read
from distdebug.runtime.exchange import ExchangeUser

MAX_NAMED = 10


class InitSeed(ExchangeUser, Detector):
    name = "init_seed"
    description = CARD.title  # one source: the card (distdebug.cards) says what it finds

    def __init__(self) -> None:
        self.ctx: RankContext | None = None
        self.initial: list[PendingFingerprints] = []  # launched before anything equalises them, read at step 1
        self._posted = False
        self._inert = False  # attached: the global first-forward hook has done its work
        self.broadcast = False  # DDP made the parameters equal after they were fingerprinted
        self.seeded = False
        self._hook: Any = None
        self._seen: set[int] = set()
        self._specs: dict[str, Any] = {}  # parameter name -> its DTensor spec when recorded (None: plain)
        self.exchange: Any = None

    def setup(self, ctx: RankContext) -> None:
        self.ctx = ctx
        from torch.nn.parallel import DistributedDataParallel

        det = self

        def make_init(init: Any) -> Any:
            def ddp_init(ddp: Any, module: Any, *args: Any, **kwargs: Any) -> None:
                det._record(module, True)  # an exception of ours: patch() switches us off, DDP is built
                init(ddp, module, *args, **kwargs)
            return ddp_init

        def make_seed(manual_seed: Any) -> Any:
            def seed(s: Any) -> Any:
                det.seeded = True
                return manual_seed(s)
            return seed

        self.patch(ctx, DistributedDataParallel, "__init__", make_init)
        self.patch(ctx, torch, "manual_seed", make_seed)
        self._hook = torch.nn.modules.module.register_module_forward_pre_hook(self.guarded(self._first_forward))

    def _record(self, module: torch.nn.Module, broadcast: bool) -> None:
        if id(module) in self._seen or not any(True for _ in module.parameters()):
            return
        if any(hasattr(p, "ds_id") for p in module.parameters()):
            return  # ZeRO-3 partitions: each rank holds other values by design
        self._seen.add(id(module))
        from distdebug.runtime.discovery import unwrap
        from distdebug.runtime.layout import spec_of

        inner = unwrap(module)[0]
        named: list[tuple[str, torch.Tensor]] = list(inner.named_parameters())
        # Computed now (before DDP's broadcast), read with step 1's values at its boundary (probe). A
        # DTensor (TP, FSDP2) is fingerprinted as its local shard; which ranks must agree on it is the
        # layout's answer at step 1 (runtime.layout), from the spec kept here: TP and FSDP shards differ
        # by design, HSDP replicas and DDP's dp peers do not.
        self.initial.append(PendingFingerprints(named))
        self._specs.update((n, spec_of(p)) for n, p in named)
        self.broadcast |= broadcast

    def _first_forward(self, module: torch.nn.Module, args: Any) -> None:
        # The outermost module's first forward (nested modules run inside it and are skipped).
        if not self.initial and not self._inert:
            self._record(module, False)  # guarded (self.guarded): an exception switches us off, said

    def attach(self, ctx: RankContext) -> None:

        from distdebug.runtime.discovery import any_compiled

        if self._hook is not None and not any_compiled():
            self._hook.remove()  # (kept when a model runs compiled: removing a global hook recompiles it)
            self._hook = None
        self._inert = True
        self.open_exchange(ctx)

    def probe(self, step: int) -> dict[str, Any] | None:
        if self._posted or self.exchange is None:
            return None
        return rows_to_read(self.initial)

    def on_step(self, event: StepEvent) -> Iterable[Finding]:
        if self._posted or self.exchange is None:
            return ()
        self._posted = True
        # None: the step's read failed; posted empty (every rank posts), judged without this rank
        fps = finish_read(self.initial, self.values(event)) or {}
        self.initial = []
        ctx = self.ctx
        assert ctx is not None  # set in setup()
        if ctx.layout is not None:
            groups = {n: ctx.layout.replicas_of_spec(self._specs.get(n)) for n in fps}
            fps = {with_group(n, g): v for n, v in fps.items() if (g := groups[n]) is not False}
        self._specs = {}
        mine = {"fps": fps, "seed": torch.initial_seed(), "seeded": self.seeded, "broadcast": self.broadcast}

        def verdicts(gathered: list[Any]) -> None:
            if ctx.rank == 0:
                for f in self._verdicts(dict(enumerate(gathered))):
                    ctx.report(f)

        self.exchange.post(mine, verdicts)
        return ()

    def _verdicts(self, per_rank: dict[int, dict[str, Any]]) -> list[Finding]:
        out = []
        ranks = sorted(per_rank)
        fps = {r: d["fps"] for r, d in per_rank.items() if d["fps"]}
        diffs = compare(fps, list(next(iter(fps.values()), {}))) if len(fps) > 1 else []
        broadcast = all(d["broadcast"] for d in per_rank.values())
        seeds = {r: d["seed"] for r, d in per_rank.items()}
        if diffs:
            names = ", ".join(d["tensor"] for d in diffs[:MAX_NAMED]) + (" ..." if len(diffs) > MAX_NAMED else "")
            culprits = sorted({r for d in diffs for r in d["ranks"]})
            # With DDP's broadcast (ranks seeded apart on purpose, or not) the replicas were made equal
            # before the first step: the training is right, nothing to report. Without it:
            if not broadcast:
                out.append(Finding(
                    severity=Severity.ERROR, detector=self.name, ranks=culprits, step=0, subject=diffs[0]["tensor"],
                    message=f"initial parameters differ across ranks and nothing broadcasts them ({len(diffs)} "
                            f"tensors: {names}): the replicas differ from step 0 and gradient averaging will "
                            f"never make them equal (torch seeds {seeds})",
                    evidence={"tensors": [d["tensor"] for d in diffs[:200]], "seeds": seeds},
                    fix="torch.manual_seed(same seed) on every rank before building the model, or broadcast the "
                        "parameters from rank 0 (dist.broadcast(p.data, 0) for each parameter), or wrap in DDP",
                ))
        if not any(d["seeded"] for d in per_rank.values()):
            out.append(Finding(
                severity=Severity.INFO, detector=self.name, ranks=ranks, step=0, subject="torch.manual_seed",
                message="torch.manual_seed was never called before the first step: torch's generator was seeded "
                        f"from the OS (seeds {seeds}), so no two runs are alike",
                evidence={"seeds": seeds},
                fix="torch.manual_seed(seed) (and random/numpy seeds) at the start, or run with --deterministic",
            ))
        return out


    def on_end(self) -> Iterable[Finding]:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.close_exchange(clean=False)
        return ()

