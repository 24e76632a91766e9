"""The rank's one cross-rank exchange: one harness gloo group and one background thread, shared by
every detector (tagged payloads), with one drain and close rule.

Why a thread: a harness collective on the training thread waits for every peer. When ranks are out
of step (one skipped a collective, one is stuck), that wait turns the script's own hang into a
deadlock inside distdebug, and the hang diagnosis then points at the harness. Here the training
thread only queues a payload; the background thread runs ``all_gather_object`` on the harness's own
gloo group (hang analysis leaves that group out) and hands the gathered payloads to the detector's
callback, which reports findings through ``ctx.report`` (thread-safe).

Why one: a group per detector is a socket mesh per detector per rank (six, at scale) and a thread
each. One group, one thread, one queue: every post is tagged with the detector's name and its post
count and matched across ranks by them (``Exchange``), so the wrong payloads are never paired.

Every rank queues the same exchanges in the same order (detectors choose them by step number), so
they pair up. At a clean end (the script destroys its process group, every rank together) the
queue is drained; at any other end the rank does not wait for peers that may never come.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable
from typing import Any

from distdebug.findings import Finding, Severity

HARNESS_GROUP_DESC = "distdebug_harness"
"""Description of the harness's own process group; hang analysis leaves its collectives out."""
THREAD_NAME = "distdebug-exchange"
DRAIN_TIMEOUT_S = 10.0
"""How long a clean end waits for the queued exchanges (every peer is ending too)."""
UNCLEAN_WAIT_S = 2.0
"""How long any other end waits: peers that are ending too pair up in a moment; others never will."""
CAPACITY = 64
"""Exchanges that may wait in the queue; one more and this rank stops exchanging (never blocks training)."""
CHECK_EVERY = 16


def open_exchange(rank: int, detectors: list[Any], report: Callable[[Finding], None],
                  raw_collectives: dict[str, Any], warn: Callable[[str], None]) -> Exchange | None:
    """The rank's exchange, made at the first step boundary on every rank alike (new_group is collective),
    when some detector uses it and there are peers; None otherwise, or when it could not be made (then
    ``warn`` says why: the cross-rank checks are off, the training goes on)."""
    if not any(getattr(d, "uses_exchange", False) for d in detectors):
        return None
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    try:
        return Exchange(rank, report, raw_collectives)
    except Exception as e:
        warn(f"could not create the harness's process group ({type(e).__name__}: {e}); cross-rank checks are "
             "off on this rank")
        return None


def checked_step(step: int) -> bool:
    """The steps at which the periodic checks exchange: early ones (2, 4, 8), then every CHECK_EVERY."""
    return step in (2, 4, 8) or step % CHECK_EVERY == 0


FLUSH, CLEAN, UNCLEAN = object(), object(), object()
"""Markers in the exchange's queue: a step boundary's posts are all made; a clean end (every rank is
ending together: closing rounds until all have closed); any other end (no round at all)."""


class Channel:
    """One detector's view of the exchange: its posts carry its tag."""

    def __init__(self, exchange: Exchange, tag: str) -> None:
        self._exchange = exchange
        self.tag = tag

    @property
    def world(self) -> int:
        return self._exchange.world

    def post(self, payload: Any, callback: Callable[[list[Any]], None],
             prepare: Callable[[Any], Any] | None = None) -> bool:
        """Queue one exchange; False (nothing queued) once the exchange has stopped or closed.

        ``callback(gathered)`` runs on the exchange thread with every rank's payload, by rank.
        ``prepare(payload)``, if given, turns the payload into what is sent, on the exchange thread
        (work the training thread need not do).
        """
        return self._exchange.post(self.tag, payload, callback, prepare)

    def gather(self, payload: Any) -> list[Any]:
        """Inside a callback only (the exchange thread): one more all_gather that every rank makes."""
        return self._exchange.gather(self.tag + "/inner", payload)


class Exchange:
    """One per rank, made by the session when a detector uses it and there are peers (world >= 2).

    The thread works in rounds: the session calls ``flush()`` once its detectors have posted what a
    step boundary (or attach) makes them post, and each flush with posts is one all_gather of them.
    Detectors post by step number, so every rank's rounds normally hold the same posts. A post is
    matched across ranks by its (tag, count), not by its place in a round, and its callback runs
    once every rank's part has arrived, in the same order on every rank (every rank sees the same
    rounds). So one detector whose posts differ across ranks (its step numbers parted after a
    skipped ``optimizer.step``, it was switched off on one rank) leaves only its own posts
    unmatched; the other detectors' exchanges go on. Nothing spins: a round waits, on this thread,
    for the peers' round. At an unclean end the thread starts no round (peers may never come, and
    a collective in flight at interpreter exit is what makes gloo abort the process).
    """

    def __init__(self, rank: int, report: Callable[[Finding], None], raw_collectives: dict[str, Any],
                 timeout_s: float = 300.0) -> None:
        import torch.distributed as dist

        self.rank = rank
        self._report = report
        self._all_gather_object = raw_collectives.get("all_gather_object", dist.all_gather_object)
        self.group: Any = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s),
                                         group_desc=HARNESS_GROUP_DESC)
        self.world = dist.get_world_size(self.group)
        self._posts: dict[str, int] = {}  # posts made per tag, on the posting thread
        self._unflushed = False  # a post since the last flush (the posting thread's)
        self._inner: dict[str, int] = {}  # inner gathers per tag, on the exchange thread
        self._queue: queue.Queue = queue.Queue()  # bounded by CAPACITY in post(), so close() never blocks
        self._parts: dict[tuple[str, int], dict[int, Any]] = {}  # (tag, count) -> rank -> payload, until complete
        self._callbacks: dict[tuple[str, int], Callable[[list[Any]], None]] = {}
        self._closed = False
        self._dropped = False
        self._muted: set[str] = set()  # tags whose callback raised on this rank: gathered, not handed on
        self._thread: threading.Thread | None = threading.Thread(target=self._worker, name=THREAD_NAME,
                                                                 daemon=True)
        self._thread.start()

    def channel(self, tag: str) -> Channel:
        return Channel(self, tag)

    @property
    def running(self) -> bool:
        return self.group is not None and not self._closed

    def post(self, tag: str, payload: Any, callback: Callable[[list[Any]], None],
             prepare: Callable[[Any], Any] | None = None) -> bool:
        if not self.running:
            return False
        n = self._posts.get(tag, 0) + 1
        self._posts[tag] = n  # counted even when refused: the next post must not pair with the peers' n
        if self._queue.qsize() >= CAPACITY:
            if not self._dropped:
                self._dropped = True
                self._say(Severity.INFO, tag, f"cross-rank exchange {CAPACITY} posts behind (a peer is gone or far "
                          "behind): posts are dropped on this rank until it catches up")
            return False
        self._queue.put((tag, n, payload, callback, prepare))
        self._unflushed = True
        return True

    def flush(self) -> None:
        """The posts of this step boundary are all made: send them (one round, if there are any). A boundary
        that posted nothing wakes no thread (most boundaries: the checks exchange at the checked steps)."""
        if self.running and self._unflushed:
            self._unflushed = False
            self._queue.put(FLUSH)

    def gather(self, tag: str, payload: Any) -> list[Any]:
        """Inside a callback: every rank runs the same callbacks in the same order, so this pairs."""
        n = self._inner.get(tag, 0) + 1
        self._inner[tag] = n
        group = self.group
        if group is None:
            raise RuntimeError("the exchange has stopped")
        gathered: list[Any] = [None] * self.world
        self._all_gather_object(gathered, ("inner", tag, n, payload), group=group)
        if any(not (isinstance(g, tuple) and g[:3] == ("inner", tag, n)) for g in gathered):
            raise OutOfStep(tag, {r: g[:3] if isinstance(g, tuple) else g for r, g in enumerate(gathered)})
        return [g[3] for g in gathered]

    def _worker(self) -> None:
        closing = False
        held: list[Any] = []  # posts waiting for the session's flush
        while self.group is not None:
            if not closing:
                item = self._queue.get()
                if item is UNCLEAN:
                    return  # no round: peers that are not ending may never join it
                if item is CLEAN:
                    closing = True
                elif item is FLUSH:
                    if not held:
                        continue  # a boundary that posted nothing: no round
                else:
                    held.append(item)
                    continue
            if closing:  # everything still queued goes in the closing rounds (markers are done with)
                while True:
                    try:
                        extra = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if extra is not FLUSH and extra is not CLEAN and extra is not UNCLEAN:
                        held.append(extra)
            # A flush sends what was posted before it, no more: posts after it wait for the next
            # flush, so that every rank's round holds the same boundary's posts.
            items, held = held, []
            outgoing = []
            for item in items:
                tag, n, payload, callback, prepare = item
                try:
                    outgoing.append((tag, n, prepare(payload) if prepare is not None else payload))
                    self._callbacks[(tag, n)] = callback
                except Exception as e:  # that post is lost on this rank; the others go on
                    self._say(Severity.ERROR, tag, f"detector '{tag}' raised {type(e).__name__}: {str(e)[:200]} "
                              "preparing a cross-rank exchange")
            try:
                everyone_closed = self._round(closing, outgoing)
            except OutOfStep as e:
                self._stop(f"ranks' exchanges no longer pair up ({e})", "exchange")
                return
            except Exception as e:  # a peer that left, a destroyed group: stop, never raise
                self._stop(f"{type(e).__name__}: {str(e)[:200]}", "exchange")
                return
            if everyone_closed:
                return

    def _round(self, closing: bool, outgoing: list[tuple[str, int, Any]]) -> bool:
        """One all_gather of this rank's new posts; run the callbacks of the posts now complete.
        Returns whether every rank has closed."""
        gathered: list[Any] = [None] * self.world
        self._all_gather_object(gathered, ("round", closing, outgoing), group=self.group)
        if any(not (isinstance(g, tuple) and len(g) == 3 and g[0] == "round") for g in gathered):
            raise OutOfStep("round", {r: g[0] if isinstance(g, tuple) else g for r, g in enumerate(gathered)})
        complete = []
        for r, (_, _, posts) in enumerate(gathered):
            for tag, n, payload in posts:
                parts = self._parts.setdefault((tag, n), {})
                parts[r] = payload
                if len(parts) == self.world:
                    complete.append((tag, n))
        for key in sorted(complete):  # the same order on every rank: every rank saw the same round
            parts = self._parts.pop(key)
            callback = self._callbacks.pop(key, None)
            if callback is None or key[0] in self._muted:
                continue
            try:
                callback([parts[r] for r in range(self.world)])
            except OutOfStep:
                raise
            except Exception as e:  # one detector's verdict code: that detector's verdicts stop here
                self._muted.add(key[0])
                self._say(Severity.ERROR, key[0], f"detector '{key[0]}' raised {type(e).__name__}: {str(e)[:200]} "
                          "judging a cross-rank exchange; its cross-rank verdicts are off on this rank")
        while len(self._parts) > 4 * CAPACITY:  # posts some peer never makes: the oldest go
            stale = next(iter(self._parts))
            self._parts.pop(stale)
            self._callbacks.pop(stale, None)
        return all(g[1] for g in gathered)

    def _stop(self, why: str, tag: str) -> None:
        if self.group is None:
            return
        self.group = None
        self._say(Severity.INFO, tag, f"cross-rank exchange stopped on this rank: {why}")

    def _say(self, severity: Severity, tag: str, message: str) -> None:
        try:
            self._report(Finding(severity=severity, detector="harness", ranks=[self.rank], step=None,
                                 subject=f"detector:{tag}", message=message))
        except Exception:  # saying so must never take the thread down
            pass

    def close(self, clean: bool) -> None:
        """clean: every rank is ending together: drain (closing rounds until every rank has closed),
        then release the group. Otherwise wait UNCLEAN_WAIT_S at most."""
        import torch.distributed as dist

        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._closed = True
        self._queue.put(CLEAN if clean else UNCLEAN)
        thread.join(timeout=DRAIN_TIMEOUT_S if clean else UNCLEAN_WAIT_S)
        group, self.group = self.group, None
        if group is not None and not thread.is_alive() and dist.is_initialized():
            dist.distributed_c10d.destroy_process_group(group)


class OutOfStep(RuntimeError):
    """The ranks' payloads at this exchange are not the same post (tag, count) on every rank."""

    def __init__(self, tag: str, keys: dict[int, Any]) -> None:
        super().__init__(f"at {tag}: " + ", ".join(f"rank {r} {k}" for r, k in keys.items()))


class ExchangeUser:
    """Mixin for detectors that exchange across ranks: ``self.exchange`` is their channel (or None).

    A detector that sets ``last_step`` in ``on_step`` and overrides ``flush_pending`` also gets what
    it gathered since its last checked step exchanged at a clean end. Whether to flush depends on
    the step number only, which every rank shares, so the exchanges still pair up. The session owns
    the exchange itself and drains and closes it once, after every detector's ``before_destroy``.
    """

    uses_exchange = True
    exchange: Channel | None = None
    last_step: int = 0

    def open_exchange(self, ctx: Any) -> bool:
        """This detector's channel, when the rank has peers to exchange with (ctx.exchange is set)."""
        shared = getattr(ctx, "exchange", None)
        if shared is None:
            return False
        self.exchange = shared.channel(getattr(self, "name", "exchange") or "exchange")
        return True

    def flush_pending(self) -> None:
        """Post what was gathered since the last checked step (override)."""

    def before_destroy(self) -> None:
        if self.exchange is not None and self.last_step and not checked_step(self.last_step):
            self.flush_pending()
        self.close_exchange()

    def close_exchange(self, clean: bool = False) -> None:
        """No more posts from this detector (the session drains the exchange)."""
        self.exchange = None
