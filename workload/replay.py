"""Replay schedules: which recorded request goes out when, as plain state a driver advances.

The driver interface (the same for :class:`AgentXReplay` and :class:`ProductionReplay`)
-------------------------------------------------------------------------------------
A replay owns every timer; the driver owns the clock and the serving. Three calls, each
returning a :class:`Wake`:

* ``start(now_s)`` once, at the driver's time zero;
* ``finished(key, now_s)`` whenever a dispatched request completes (``key = Dispatch.key``);
* ``poll(now_s)`` whenever ``now_s`` reaches the last ``Wake.next_due_s``.

``Wake.ready`` are the dispatches due now: issue each one at once (its ``in_tokens`` prompt with
``block_ids()`` under ``scope``, generating ``out_tokens``). ``Wake.next_due_s`` is when to
``poll`` next if nothing finishes first (``None``: only a finish can make anything due);
``Wake.done``: nothing is in flight and nothing more will be dispatched. Timers may move
earlier after a later call (idle caps), so a driver must not cache ``next_due_s`` across calls:
always sleep on the newest one. ``Dispatch.measured`` is False for warm-up, primer and cold
requests, which metrics exclude. For a progress display a replay tells where it stands:
``warmup_left`` (primer and warm-up requests not yet finished; 0 once the window opens, and
always for production replay), ``window_start_s`` (when the measured window opened; None until
then) and ``duration_s`` (the window's length). A minimal SimPy driver (``kvpool.sim.driver`` does the same
with callbacks instead of processes)::

    def driver(env, replay, serve):          # serve(dispatch) is a SimPy process function
        wakeup = [env.event()]

        def run(d):
            yield env.process(serve(d))
            issue(replay.finished(d.key, env.now))
            if not wakeup[0].triggered:
                wakeup[0].succeed()

        def issue(w):
            for d in w.ready:
                env.process(run(d))
            return w

        w = issue(replay.start(env.now))
        while not w.done:
            timer = env.timeout(w.next_due_s - env.now) if w.next_due_s is not None else env.event()
            yield wakeup[0] | timer
            wakeup[0] = env.event()
            w = issue(replay.poll(env.now))

A real client does the same with asyncio (wait on a condition with a timeout). See also
:func:`run_fixed_latency`, a tiny event loop used by the tests and ``kvpool trace`` tools.

AgentX lanes (:class:`AgentXReplay`, ../shared/reference/agentx-traces.md §2)
-----------------------------------------------------------------------------
* ``lanes`` live session trees; lane i starts on eligible trace i (wrapping), later draws take
  the next trace in order; a lane takes its next trace when its whole tree (background subagents
  included) has finished, replayed from turn 0 with a fresh ``scope`` (cache bust).
* A request goes out when all its dependencies (previous request of its thread, spawning turn,
  joined subagents) finished live, plus the recorded end-to-start gap after each.
* Idle caps: once a tree has nothing in flight, its pending timers are advanced uniformly so
  that its next request is due at most ``idle_cap_s`` later; with ``system_idle_cap_s``, the
  same for all timers once nothing at all is in flight.
* Warm-up (first trees only): start point ``t* = start + u * span``, ``u`` uniform in
  ``[start_fraction_min, start_fraction_max]`` drawn from ``default_rng(first 8 bytes (big-endian)
  of sha256("{seed}:{trace id}:{lane}"))``. Requests before t* are skipped, except primers: the
  last request before t* of every thread that continues after it, sent at start. Then the next
  ``warmup_requests`` requests of the tree go out with no gaps. Primers and warm-up requests
  generate 1 token and are not measured. Requests ready before every lane's warm-up finished
  are held; at that barrier (``profile_start_s``) each keeps its next-turn delay (capped at
  ``idle_cap_s``) minus the smallest one, so the earliest starts at once. At least one
  measured request is always left in a trace.
* Outputs are the recorded lengths (``max_output_tokens`` caps main-thread turns); traces whose
  peak ``in + out`` exceeds ``max_context_tokens`` are skipped (``skipped_traces``).
* Nothing is dispatched at or after ``profile_start_s + duration_s``.

Production replay (:class:`ProductionReplay`, the seed's Figure 7)
----------------------------------------------------------------
``lanes`` lanes each hold a session, started at a uniform position in
``[start_fraction_min, start_fraction_max]`` of its requests (time order, all threads);
arrivals are Poisson at ``rps``; each arrival sends the next request of a uniformly chosen idle
lane (one with nothing in flight), or waits for the first lane to free. The first request of
every session a lane plays is ``phase="cold"`` (not measured: the seed's Figure 7 reports warm
turns), and so is the first request of every other thread whose earlier requests the partway
start skipped (its history was never sent, so it is cold only because of where the lane
started); a finished session is replaced by the next one from turn 0.
Recorded gaps are not used.

Determinism: everything random comes from ``numpy.random.default_rng`` seeded from ``seed``.
"""

from __future__ import annotations

import hashlib
import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from kvpool.workload.errors import TraceError
from kvpool.workload.model import Request, Session, Workload

Phase = Literal["primer", "warmup", "profile", "cold"]
_EPS_S = 1e-9


@dataclass(frozen=True, slots=True)
class Dispatch:
    """One request to send now.

    Attributes:
        key: unique id of this dispatch; pass it back to ``finished``.
        lane: the lane (AgentX) or replay lane it belongs to.
        play: unique id of this play of the session (a recycled trace gets a new one).
        session: the recorded session.
        request: the recorded request.
        scope: chunk-key scope (``policy.chunks.chain_seed(namespace, scope)``): the session id
            plus the play for local ids, so plays never share cache; ``""`` for global ids.
        out_tokens: tokens to generate.
        phase: ``primer`` / ``warmup`` / ``cold`` (not measured) or ``profile``.
        due_s: when it became due (driver time).
    """

    key: int
    lane: int
    play: int
    session: Session
    request: Request
    scope: str
    out_tokens: int
    phase: Phase
    due_s: float

    @property
    def measured(self) -> bool:
        return self.phase == "profile"

    @property
    def in_tokens(self) -> int:
        return self.request.in_tokens

    def block_ids(self) -> np.ndarray:
        return self.session.block_ids(self.request.index)


@dataclass(frozen=True, slots=True)
class Wake:
    """What the driver does next: issue ``ready`` now; poll at ``next_due_s``; stop when ``done``."""

    ready: tuple[Dispatch, ...]
    next_due_s: float | None
    done: bool


def _scope(s: Session, play: int) -> str:
    return f"{s.id}#p{play}" if s.hash_scope == "local" else ""


def start_fraction_rng(seed: int, trace_id: str, lane: int) -> np.random.Generator:
    """The generator of a lane's start point (the seed rule of the reference harness)."""
    digest = hashlib.sha256(f"{seed}:{trace_id}:{lane}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "big"))


def eligible_sessions(workload: Workload | Sequence[Session], max_context_tokens: int | None) -> tuple[list[Session], list[str]]:
    """(kept sessions, ids of skipped ones) under the peak-context limit; error if none is kept."""
    sessions = list(workload)
    if max_context_tokens is None:
        return sessions, []
    keep = [s for s in sessions if s.peak_context_tokens <= max_context_tokens]
    skipped = [s.id for s in sessions if s.peak_context_tokens > max_context_tokens]
    if not keep:
        smallest = min((s.peak_context_tokens for s in sessions), default=0)
        raise TraceError(f"every trace's peak context exceeds workload.max_context_tokens={max_context_tokens} "
                         f"(the smallest peak is {smallest} tokens); raise workload.max_context_tokens or use other traces")
    return keep, skipped


class _SessionGraph:
    """Per-session dependents lists, computed once: ``dependents[i] = [(j, gap_s), ...]``."""

    def __init__(self, s: Session):
        reqs = s.requests
        self.n_deps = [len(r.deps) for r in reqs]
        dependents: list[list[tuple[int, float]]] = [[] for _ in reqs]
        for r in reqs:
            deps = r.deps
            if deps:
                i = r.index
                for d in deps:
                    dependents[d.request].append((i, d.gap_s))
        self.dependents = dependents


@dataclass
class _Play:
    lane: int
    play: int
    session: Session
    graph: _SessionGraph
    scope: str
    waiting: list[int]
    ready_after: list[float]
    phase: dict[int, Phase] = field(default_factory=dict)
    pending: dict[int, float] = field(default_factory=dict)  # released request -> due
    inflight: int = 0
    remaining: int = 0
    first: int = 0  # requests before it were skipped (or sent as primers)


class AgentXReplay:
    """AgentX lanes with end-to-start pacing, idle caps and warm-up (see module docstring)."""

    def __init__(
        self,
        workload: Workload | Sequence[Session],
        *,
        lanes: int,
        seed: int,
        duration_s: float = math.inf,
        idle_cap_s: float | None = 300.0,
        system_idle_cap_s: float | None = None,
        warmup_requests: int = 3,
        start_fraction_min: float = 0.25,
        start_fraction_max: float = 0.75,
        warmup: bool = True,
        max_context_tokens: int | None = None,
        max_output_tokens: int | None = None,
        recycle: bool = True,
    ):
        if lanes <= 0:
            raise ValueError(f"lanes must be > 0, got {lanes}")
        if not 0 <= start_fraction_min <= start_fraction_max <= 1:
            raise ValueError("need 0 <= start_fraction_min <= start_fraction_max <= 1")
        self.sessions, self.skipped_traces = eligible_sessions(workload, max_context_tokens)
        self.lanes = lanes
        self.seed = seed
        self.duration_s = duration_s
        self.idle_cap_s = idle_cap_s
        self.system_idle_cap_s = system_idle_cap_s
        self.warmup_requests = warmup_requests
        self.start_fraction = (start_fraction_min, start_fraction_max)
        self.warmup = warmup
        self.max_output_tokens = max_output_tokens
        self.recycle = recycle
        self.profile_start_s: float | None = None
        self._graphs: dict[int, _SessionGraph] = {}
        self._plays: list[_Play | None] = [None] * lanes
        self._cursor = lanes  # the next trace a lane draws (lane i starts on trace i)
        self._n_plays = 0
        self._keys = 0
        self._inflight: dict[int, tuple[_Play, int]] = {}
        self._held: list[tuple[_Play, int, float]] = []  # before the barrier: (play, request, delay)
        self._warm_left = 0  # primer + warm-up dispatches not yet finished
        # every (due, lane, request, push number, play) set in a play's ``pending``; entries whose
        # due no longer matches are stale and skipped (dues only move by the idle caps)
        self._dues: list[tuple[float, int, int, int, _Play]] = []
        self._pushes = 0

    # -- driver interface ---------------------------------------------------------------------
    def start(self, now_s: float) -> Wake:
        for lane in range(self.lanes):
            self._new_play(lane, now_s, initial=True)
        if not self.warmup or self._warm_left == 0:
            self._barrier(now_s)
        return self._wake(now_s)

    def finished(self, key: int, now_s: float) -> Wake:
        play, i = self._inflight.pop(key)
        play.inflight -= 1
        play.remaining -= 1
        if play.phase.get(i) in ("primer", "warmup"):
            self._warm_left -= 1
        for j, gap in play.graph.dependents[i]:
            if j < play.first:  # skipped before the start point
                continue
            delay = 0.0 if play.phase.get(j) == "warmup" else gap
            play.ready_after[j] = max(play.ready_after[j], now_s + delay)
            play.waiting[j] -= 1
            if play.waiting[j] == 0:
                self._release(play, j, now_s)
        if play.remaining == 0 and play.inflight == 0 and not play.pending:
            self._plays[play.lane] = None
            if self.recycle and not self._ended(now_s):
                self._new_play(play.lane, now_s, initial=False)
        if self.profile_start_s is None and self._warm_left == 0:
            self._barrier(now_s)
        self._cap_tree(play, now_s)
        return self._wake(now_s)

    def poll(self, now_s: float) -> Wake:
        return self._wake(now_s)

    @property
    def warmup_left(self) -> int:
        """Primer and warm-up requests not yet finished (``start`` sets how many there are)."""
        return self._warm_left

    @property
    def window_start_s(self) -> float | None:
        """When the measured window opened (``profile_start_s``); None during the warm-up."""
        return self.profile_start_s

    # -- internals ----------------------------------------------------------------------------
    def _graph(self, s: Session) -> _SessionGraph:
        g = self._graphs.get(id(s))
        if g is None:
            g = self._graphs[id(s)] = _SessionGraph(s)
        return g

    def _ended(self, now_s: float) -> bool:
        return self.profile_start_s is not None and now_s >= self.profile_start_s + self.duration_s

    def _new_play(self, lane: int, now_s: float, *, initial: bool) -> None:
        if initial:
            s = self.sessions[lane % len(self.sessions)]
        else:
            s = self.sessions[self._cursor % len(self.sessions)]
            self._cursor += 1
        g = self._graph(s)
        play = _Play(
            lane=lane, play=self._n_plays, session=s, graph=g, scope=_scope(s, self._n_plays),
            waiting=list(g.n_deps), ready_after=[-math.inf] * len(s.requests), remaining=len(s.requests),
        )
        self._n_plays += 1
        self._plays[lane] = play
        first = 0
        if initial and self.warmup:
            first = play.first = self._start_index(s, lane)
            n_warm = min(self.warmup_requests, len(s.requests) - 1 - first)
            for j in range(first, first + n_warm):
                play.phase[j] = "warmup"
            threads_after = {s.requests[j].thread for j in range(first, len(s.requests))}
            primers = set()
            for th in s.threads:
                before = [i for i in th.requests if i < first]
                if before and th.index in threads_after:
                    primers.add(before[-1])
            for i in range(first):  # skipped: satisfied, contributes no time
                play.remaining -= 1
                if i in primers:
                    continue
                for j, _ in g.dependents[i]:
                    play.waiting[j] -= 1
            for i in sorted(primers):
                play.remaining += 1
                play.phase[i] = "primer"
                play.waiting[i] = 0
                self._warm_left += 1
                self._set_due(play, i, now_s)
            self._warm_left += n_warm
        for j in range(first, len(s.requests)):
            if play.waiting[j] == 0:
                self._release(play, j, now_s)

    def _start_index(self, s: Session, lane: int) -> int:
        lo, hi = self.start_fraction
        u = float(start_fraction_rng(self.seed, s.id, lane).uniform(lo, hi))
        t_star = s.start_s + u * s.span_s
        first = next((r.index for r in s.requests if r.t_s >= t_star), len(s.requests) - 1)
        return min(first, len(s.requests) - 1)

    def _release(self, play: _Play, j: int, now_s: float) -> None:
        due = max(now_s, play.ready_after[j])
        if play.phase.get(j) is None and self.profile_start_s is None and self.warmup:
            self._held.append((play, j, due - now_s))
            return
        self._set_due(play, j, due)

    def _set_due(self, play: _Play, j: int, due: float) -> None:
        play.pending[j] = due
        self._pushes += 1
        heapq.heappush(self._dues, (due, play.lane, j, self._pushes, play))

    def _shift_dues(self, play: _Play, shift: float) -> None:
        """Advance every pending timer of ``play`` by ``shift`` seconds (the idle caps)."""
        for j, due in list(play.pending.items()):
            self._set_due(play, j, due - shift)

    def _barrier(self, now_s: float) -> None:
        self.profile_start_s = now_s
        if not self._held:
            return
        cap = math.inf if self.idle_cap_s is None else self.idle_cap_s
        delays = [min(d, cap) for _, _, d in self._held]
        base = min(delays)
        for (play, j, _), d in zip(self._held, delays):
            self._set_due(play, j, now_s + d - base)
        self._held = []

    def _cap_tree(self, play: _Play, now_s: float) -> None:
        if self.idle_cap_s is None or play.inflight or not play.pending:
            return
        shift = min(play.pending.values()) - now_s - self.idle_cap_s
        if shift > 0:
            self._shift_dues(play, shift)

    def _cap_system(self, now_s: float) -> None:
        if self.system_idle_cap_s is None or self._inflight:
            return
        plays = [p for p in self._plays if p is not None and p.pending]
        if not plays:
            return
        shift = min(min(p.pending.values()) for p in plays) - now_s - self.system_idle_cap_s
        if shift > 0:
            for p in plays:
                self._shift_dues(p, shift)

    def _wake(self, now_s: float) -> Wake:
        self._cap_system(now_s)
        end = math.inf if self.profile_start_s is None else self.profile_start_s + self.duration_s
        dues = self._dues
        due_now: list[tuple[int, float, int, _Play]] = []
        while dues:
            due, lane, j, _, play = dues[0]
            if play.pending.get(j) != due:  # stale: dispatched, or moved by an idle cap
                heapq.heappop(dues)
            elif due <= now_s + _EPS_S and due < end:
                heapq.heappop(dues)
                due_now.append((lane, due, j, play))
            else:
                break
        # the earliest live due left: the top, unless it lies past the end of the run
        live = bool(due_now) or bool(dues and dues[0][0] < end)
        nxt = dues[0][0] if dues and dues[0][0] < end else None
        ready: list[Dispatch] = []
        if len(due_now) > 1:
            due_now.sort(key=lambda e: e[:3])  # lane order, then due
        for _, due, j, play in due_now:
            del play.pending[j]
            ready.append(self._dispatch(play, j, due))
        done = not self._inflight and not live and (self.profile_start_s is not None or not self._held)
        return Wake(tuple(ready), nxt, done)

    def _dispatch(self, play: _Play, j: int, due: float) -> Dispatch:
        r = play.session.requests[j]
        phase = play.phase.get(j, "profile")
        out = r.out_tokens
        if phase != "profile":
            out = 1
        elif self.max_output_tokens is not None and r.thread == 0:
            out = min(out, self.max_output_tokens)
        key = self._keys
        self._keys += 1
        self._inflight[key] = (play, j)
        play.inflight += 1
        return Dispatch(key, play.lane, play.play, play.session, r, play.scope, out, phase, due)


class ProductionReplay:
    """Poisson arrivals over lanes that start partway into sessions (see module docstring)."""

    def __init__(
        self,
        workload: Workload | Sequence[Session],
        *,
        lanes: int,
        rps: float,
        seed: int,
        duration_s: float,
        start_fraction_min: float = 0.0,
        start_fraction_max: float = 1.0,
        max_context_tokens: int | None = None,
        max_output_tokens: int | None = None,
    ):
        if lanes <= 0 or rps <= 0 or duration_s <= 0:
            raise ValueError("lanes, rps and duration_s must be > 0")
        self.sessions, self.skipped_traces = eligible_sessions(workload, max_context_tokens)
        self.lanes = lanes
        self.rps = rps
        self.duration_s = duration_s
        self.max_output_tokens = max_output_tokens
        self._rng = np.random.default_rng(seed)
        self._frac = (start_fraction_min, start_fraction_max)
        self._pos: list[int] = []
        self._sess: list[Session] = []
        self._play: list[int] = []
        self._first: list[bool] = []
        self._skipped: list[set[int]] = []
        self._busy: list[bool] = [False] * lanes
        self._cursor = lanes
        self._n_plays = 0
        self._keys = 0
        self._inflight: dict[int, int] = {}
        self._queued: list[float] = []  # arrivals waiting for a free lane
        self.start_s = 0.0
        self._next_arrival = math.inf

    def start(self, now_s: float) -> Wake:
        self.start_s = now_s
        for lane in range(self.lanes):
            s = self.sessions[lane % len(self.sessions)]
            lo, hi = self._frac
            pos = int(math.floor(self._rng.uniform(lo, hi) * len(s.requests)))
            self._sess.append(s)
            self._pos.append(min(pos, len(s.requests) - 1))
            self._play.append(self._n_plays)
            self._n_plays += 1
            self._first.append(True)
            # threads whose earlier requests the partway start skipped: their next request is cold
            self._skipped.append({r.thread for r in s.requests[: self._pos[-1]]})
        self._next_arrival = now_s + float(self._rng.exponential(1.0 / self.rps))
        return self.poll(now_s)

    def finished(self, key: int, now_s: float) -> Wake:
        lane = self._inflight.pop(key)
        self._busy[lane] = False
        if self._pos[lane] >= len(self._sess[lane].requests):
            s = self.sessions[self._cursor % len(self.sessions)]
            self._cursor += 1
            self._sess[lane], self._pos[lane] = s, 0
            self._play[lane] = self._n_plays
            self._n_plays += 1
            self._first[lane] = True  # a new session's first turn is cold too: the seed counts warm turns
            self._skipped[lane] = set()
        return self.poll(now_s)

    def poll(self, now_s: float) -> Wake:
        end = self.start_s + self.duration_s
        while self._next_arrival <= now_s + _EPS_S and self._next_arrival < end:
            self._queued.append(self._next_arrival)
            self._next_arrival += float(self._rng.exponential(1.0 / self.rps))
        ready = []
        while self._queued:
            idle = [k for k in range(self.lanes) if not self._busy[k]]
            if not idle:
                break
            lane = idle[int(self._rng.integers(len(idle)))]
            ready.append(self._dispatch(lane, self._queued.pop(0)))
        nxt = self._next_arrival if self._next_arrival < end else None
        done = nxt is None and not self._inflight and not self._queued
        return Wake(tuple(ready), nxt, done)

    warmup_left = 0  # no warm-up: the window opens at ``start``

    @property
    def window_start_s(self) -> float | None:
        """When the measured window opened: the replay's start."""
        return self.start_s

    def _dispatch(self, lane: int, due: float) -> Dispatch:
        s = self._sess[lane]
        r = s.requests[self._pos[lane]]
        self._pos[lane] += 1
        cold = self._first[lane] or r.thread in self._skipped[lane]
        phase: Phase = "cold" if cold else "profile"
        self._first[lane] = False
        self._skipped[lane].discard(r.thread)
        out = r.out_tokens if self.max_output_tokens is None else min(r.out_tokens, self.max_output_tokens)
        key = self._keys
        self._keys += 1
        self._inflight[key] = lane
        self._busy[lane] = True
        return Dispatch(key, lane, self._play[lane], s, r, _scope(s, self._play[lane]), out, phase, due)


@dataclass(frozen=True, slots=True)
class Served:
    """One dispatch as served by :func:`run_fixed_latency`."""

    dispatch: Dispatch
    start_s: float
    end_s: float


def run_fixed_latency(
    replay: AgentXReplay | ProductionReplay,
    latency_s: Callable[[Dispatch], float],
    *,
    until_s: float = math.inf,
    max_dispatches: int = 10_000_000,
) -> list[Served]:
    """Drive a replay with a fixed service time per dispatch (no queueing); the served log.

    A minimal reference driver: the simulator replaces ``latency_s`` by its cluster model.
    """
    log: list[Served] = []
    events: list[tuple[float, int, int]] = []  # (finish time, order, key)
    by_key: dict[int, tuple[Dispatch, float]] = {}
    now = 0.0
    order = 0

    def issue(w: Wake) -> Wake:
        nonlocal order
        for d in w.ready:
            by_key[d.key] = (d, now)
            heapq.heappush(events, (now + latency_s(d), order, d.key))
            order += 1
        return w

    w = issue(replay.start(now))
    while not w.done and len(log) < max_dispatches:
        t_fin = events[0][0] if events else math.inf
        t_due = w.next_due_s if w.next_due_s is not None else math.inf
        now = min(t_fin, t_due)
        if now == math.inf or now > until_s:
            break
        if t_fin <= t_due:
            _, _, key = heapq.heappop(events)
            d, started = by_key.pop(key)
            log.append(Served(d, started, now))
            w = issue(replay.finished(key, now))
        else:
            w = issue(replay.poll(now))
    return log
