"""The wrong shard: a rank that restored the file another rank saved, while it saved a sibling file of its
own (``ckpt_0.pt`` / ``ckpt_1.pt``) and never restored that one.

Why a mechanism of its own: it is judged later than the load (at the next step boundary and at the end):
DeepSpeed's elastic ZeRO load reads every rank's file, its own included, which is right; only a rank that
never reads its own is wrong. loads.py queues the candidates in ``_foreign``."""

from __future__ import annotations

from pathlib import Path

from distdebug.detectors.checkpoint_roundtrip.core import RoundTripState
from distdebug.findings import Finding, Severity


class WrongShards(RoundTripState):
    """The deferred judgement of restores of another rank's file."""

    def _wrong_shards(self) -> list[Finding]:
        ctx = self.ctx
        assert ctx is not None  # set in setup()/attach(), which the session calls first
        with self._lock:
            pending, self._foreign = self._foreign, []
            loaded = set(self._loaded)
        out = []
        for item in pending:
            if any(p in loaded for p in item["own"]):
                continue
            rank, name = ctx.rank, Path(item["path"]).name
            out.append(Finding(
                severity=Severity.ERROR, detector=self.name, ranks=[rank], step=item["step"], subject=name,
                message=f"rank {rank} restored {name}, which rank {item['saver']} saved, although it saved "
                        f"its own ({', '.join(Path(p).name for p in item['own'])[:200]}) and did not restore "
                        "that: a sharded checkpoint restored from the wrong shard",
                evidence={"path": item["path"], "saved_by": item["saver"], "own_files": item["own"][:20]},
                fix="load the file this rank saved (index paths by rank), or load through the sharding-aware API "
                    "(torch.distributed.checkpoint, engine.load_checkpoint)",
            ))
        return out
