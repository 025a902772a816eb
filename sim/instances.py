"""Prefill and decode instances as SimPy actors.

Prefill (``PrefillInstance``): the prefill engine's pipeline. Chunked prefill in steps of at most
``max_batched_tokens`` tokens, FIFO over the requests whose KV is ready
(``policy.prefill_steps``, the engine's rule: a chunk that does not reach the end of its range is
cut to whole pages; with ``prefill.spread_requests`` a step takes at most the computes' share over
the stages). A step takes the cost model's time for one stage's share of its work at stage 0,
then passes every later stage in order, each stage taking its steps in the order they came, once
it has ended the steps before; its requests' last chunks complete when it leaves the last stage,
and a new step starts at stage 0 only while fewer than ``pp`` steps are in flight. ``pages`` is
the instance's paged KV and GPU prefix cache (``sim.steps.pages``). Per stage, pool loads run on
``load_workers_per_stage`` load workers (ATOM's default is one), each stage starting its load
after the forwards queued ahead of it.

Decode (``DecodeInstance``): continuous batching as a fluid model. Between joins and leaves the
step time is constant (cost model of the running batch), every sequence advances
``mtp_accept_tokens`` tokens per step; the next event is the first sequence to finish. A request
joins when its KV fits (``in + out`` tokens reserved of the instance's KV capacity) and the batch
has room (``max_seqs``); its first token comes one step after it joins.

Where the workers share devices (``sim.devices``) a stage's step takes its time alone x the
placement's factor when the stage starts it, and the decode's step its time alone x its factor,
repriced whenever another worker on its devices starts or stops.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING

import simpy

from kvpool.policy.prefill_steps import pack_step, step_requests
from kvpool.sim.cost import CostModel
from kvpool.sim.events import call_later, fire

if TYPE_CHECKING:
    from kvpool.sim.devices import Placement
    from kvpool.sim.steps.pages import PrefillPages


class Workers:
    """``capacity`` workers serving jobs first come, first served, without SimPy processes.

    ``submit(start)`` calls ``start()`` as soon as a worker is free (at once when one is); the job
    calls ``release()`` when it is done, which starts the next queued job at that moment."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"workers: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.busy = 0
        self._jobs: deque[Callable[[], None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._jobs)

    def submit(self, start: Callable[[], None]) -> None:
        if self.busy < self.capacity:
            self.busy += 1
            start()
        else:
            self._jobs.append(start)

    def release(self) -> None:
        if self._jobs:
            self._jobs.popleft()()
        else:
            self.busy -= 1


@dataclass
class _Flight:
    """A step on its way through the stages after stage 0."""

    alone_s: float  # one stage's time for it, computed alone
    finished: list[_Compute]  # the computes whose last chunk it holds


@dataclass
class _Compute:
    remaining: int
    context: int
    done: simpy.Event
    start_s: float = -1.0  # when its first step began
    cancelled: bool = False


class PrefillInstance:
    def __init__(self, env: simpy.Environment, index: int, server: int, gpus: list[int], *, pp: int, tp: int,
                 max_batched_tokens: int, cost: CostModel, pages: PrefillPages | None, page_tokens: int,
                 spread_requests: bool, load_workers: int) -> None:
        self.env = env
        self.index = index
        self.server = server
        self.gpus = gpus
        self.pp = pp
        self.tp = tp
        self.max_batched_tokens = max_batched_tokens
        self.cost = cost
        #: the paged KV and GPU prefix cache (``sim.steps.pages``; ``None`` only where a test
        #: drives the pipeline alone)
        self.pages = pages
        self.loaders = [Workers(load_workers) for _ in range(pp * tp)]
        self.outstanding_tokens = 0
        self.step_s = 0.0
        self.busy_s = 0.0
        self.computed_tokens = 0
        self._computes: deque[_Compute] = deque()
        self._idle = True  # no step under way or about to start
        #: a step's chunks end on multiples of this many tokens (``policy.prefill_steps``): the page
        self.step_page_tokens = page_tokens
        #: ``prefill.spread_requests``: a step takes at most the computes' share over the stages
        #: (``policy.prefill_steps.step_requests``)
        self.spread_requests = spread_requests
        self._stage_queue: list[deque[_Flight]] = [deque() for _ in range(pp)]  # steps waiting for stage j >= 1
        self._stage_computing = [False] * pp  # whether stage j >= 1 computes a step now
        self._flying = 0  # steps that have started at stage 0 and not yet left the last stage
        #: the time integral of the steps in flight (step-seconds), up to ``_flying_mark_s`` (the
        #: engine's ``kvpool:prefill_steps_in_flight_seconds``)
        self.steps_in_flight_s = 0.0
        self._flying_mark_s = 0.0
        self._room_wanted = False  # the next step waits for a step in flight to leave
        #: with workers sharing devices (``sim.devices``): each stage's placement, else None
        self.placements: list[Placement] | None = None

    @property
    def ranks(self) -> int:
        return self.pp * self.tp

    def rank_gpu(self, rank: int) -> int:
        return self.gpus[rank % len(self.gpus)]

    def queued_tokens(self) -> int:
        return sum(c.remaining for c in self._computes)

    def compute(self, tokens: int, context: int) -> simpy.Event:
        """An event that succeeds when ``tokens`` tokens after ``context`` cached ones are computed;
        its value is when the first step computing them began (``None`` for no tokens)."""
        done = self.env.event()
        if tokens <= 0:
            done.succeed()
            return done
        self._computes.append(_Compute(tokens, context, done))
        if self._idle:  # the first step starts now, after what is already due now
            self._idle = False
            call_later(self.env, 0.0, self._step)
        return done

    def cancel(self, done: simpy.Event) -> bool:
        """Drop the queued compute of ``done`` (a failed request's); its event never succeeds. A step
        under way that holds part of it still takes its time. False if it is no longer queued."""
        for c in self._computes:
            if c.done is done:
                self._computes.remove(c)
                c.cancelled = True
                return True
        return False

    def _step(self, ev=None) -> None:
        """Start a step over the queue's head (written as callbacks: a step is one scheduled
        call, which takes the next step or goes idle when it ends)."""
        if not self._computes:  # cancelled while the step was due
            self.step_s = 0.0
            self._idle = True
            return
        if self._flying >= self.pp:  # wait for a step in flight to leave (_leave_stage)
            self._room_wanted = True
            return
        now = self.env.now
        taken = step_requests(len(self._computes), self.pp, self.spread_requests)
        takes = pack_step((c.remaining for c in islice(self._computes, taken)), self.max_batched_tokens,
                          self.step_page_tokens)
        batch: list[tuple[_Compute, int]] = list(zip(self._computes, takes))
        for c, _ in batch:
            if c.start_s < 0:
                c.start_s = now
        alone = self.cost.prefill_step_s([(take, c.context) for c, take in batch])
        self._count_flying(+1)
        step = alone * self._stage_starts(0)
        self.step_s = step
        call_later(self.env, step, self._step_done, (batch, step, alone))

    def _step_done(self, ev) -> None:
        batch, step, alone = ev.value
        self.busy_s += step
        finished = []
        for c, take in batch:
            c.remaining -= take
            c.context += take
            self.computed_tokens += take
            if c.remaining == 0 and not c.cancelled:
                self._computes.remove(c)
                finished.append(c)
        self._stage_ends(0)
        self._leave_stage(0, _Flight(alone, finished))
        if self._computes:
            self._step()
        else:
            self.step_s = 0.0
            self._idle = True

    # a step passes stage 1, 2, ... in turn; each stage takes its steps in order

    def _leave_stage(self, stage: int, flight: _Flight) -> None:
        """``flight`` has left ``stage``: on to the next stage, or out of the pipeline after the last
        (its finished computes complete, and a step waiting for room may start)."""
        after = stage + 1
        if after < self.pp:
            self._stage_queue[after].append(flight)
            if not self._stage_computing[after]:
                self._next_on_stage(after)
            return
        self._count_flying(-1)
        for c in flight.finished:
            call_later(self.env, 0.0, lambda _e, d=c.done, t=c.start_s: fire(d, t))
        if self._room_wanted:
            self._room_wanted = False
            self._step()

    def _count_flying(self, delta: int) -> None:
        """Add the steps in flight since the last change to ``steps_in_flight_s``, then change them by ``delta``."""
        now = self.env.now
        self.steps_in_flight_s += self._flying * (now - self._flying_mark_s)
        self._flying_mark_s = now
        self._flying += delta

    def _next_on_stage(self, stage: int) -> None:
        flight = self._stage_queue[stage].popleft()
        self._stage_computing[stage] = True
        call_later(self.env, flight.alone_s * self._stage_starts(stage), self._stage_done, (stage, flight))

    def _stage_done(self, ev) -> None:
        stage, flight = ev.value
        self._stage_computing[stage] = False
        self._stage_ends(stage)
        self._leave_stage(stage, flight)
        if self._stage_queue[stage]:
            self._next_on_stage(stage)

    def _stage_starts(self, stage: int) -> float:
        """``stage`` starts a step now: what its time alone is multiplied by (the workers beside it)."""
        if self.placements is None:
            return 1.0
        placement = self.placements[stage]
        factor = placement.factor()
        placement.start()
        return factor

    def _stage_ends(self, stage: int) -> None:
        if self.placements is not None:
            self.placements[stage].stop()


@dataclass
class _Seq:
    tag: float  # finishes when the instance's generation clock reaches this
    base: int  # context = base + clock
    reserved: int
    first: simpy.Event
    done: simpy.Event



class DecodeInstance:
    """Continuous batching as a fluid model (see the module docstring).

    Implementation: every running sequence gains the same tokens per step, so one generation
    clock (tokens per sequence since the instance started) describes them all: a sequence
    finishes when the clock reaches its tag (clock at join + output tokens), and the batch's
    context is the sum of the sequences' bases plus ``running x clock``. Joins and finishes cost
    O(log n); nothing loops over the batch."""

    def __init__(self, env: simpy.Environment, index: int, server: int, gpus: list[int], *, capacity_tokens: int,
                 max_seqs: int, tokens_per_step: float, cost: CostModel,
                 on_occupancy: Callable[[float, float], None] | None = None) -> None:
        self.env = env
        self.index = index
        self.server = server
        self.gpus = gpus
        self.capacity_tokens = capacity_tokens
        self.max_seqs = max_seqs
        self.tokens_per_step = tokens_per_step
        self.cost = cost
        self.reserved_tokens = 0
        self._running: list[tuple[float, int, _Seq]] = []  # heap by (tag, join number)
        self._joins = 0
        self._base_sum = 0
        self._clock = 0.0
        self._waiting: deque[tuple[int, int, int, simpy.Event, simpy.Event]] = deque()
        self._last = env.now
        self._version = 0
        self._step = 0.0
        self._on_occupancy = on_occupancy
        self._new: list[_Seq] = []  # joined since the last reschedule (first token pending)
        self._wake_cb = self._wake  # bound once: a wake-up is scheduled per join and finish
        self._alone_step = 0.0  # the running batch's step, computed alone
        #: with workers sharing devices (``sim.devices``): this instance's placement, else None
        self.placement: Placement | None = None

    def share_devices(self, placement: Placement) -> None:
        """Compute on ``placement``'s devices: a step takes its time alone x ``placement.factor()``,
        repriced whenever another worker there starts or stops."""
        self.placement = placement
        placement.listen(self._devices_changed)

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.reserved_tokens

    @property
    def running(self) -> int:
        return len(self._running)

    def kv_tokens(self) -> int:
        return int(self._base_sum + len(self._running) * self._clock)

    def generate(self, in_tokens: int, out_tokens: int) -> tuple[simpy.Event, simpy.Event]:
        """(first token, finished) events for a request whose KV has arrived."""
        first, done = self.env.event(), self.env.event()
        self._waiting.append((in_tokens, max(1, out_tokens), in_tokens + max(1, out_tokens), first, done))
        self._advance()
        self._admit()
        self._reschedule()
        return first, done

    def cancel(self, first: simpy.Event) -> bool:
        """Drop a waiting request (a failed one's, by its first-token event): it never joins.
        False if it has joined the batch already."""
        for i, w in enumerate(self._waiting):
            if w[3] is first:
                del self._waiting[i]
                if i == 0:  # it may have kept the next ones out
                    self._advance()
                    self._admit()
                    self._reschedule()
                return True
        return False

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last
        if dt > 0 and self._running and self._step > 0:
            self._clock += dt / self._step * self.tokens_per_step
        self._last = now

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_seqs:
            inp, out, need, first, done = self._waiting[0]
            if need > self.free_tokens and self._running:
                break
            self._waiting.popleft()
            self.reserved_tokens += need
            base = inp - self._clock
            self._base_sum += base
            self._joins += 1
            seq = _Seq(self._clock + out, base, need, first, done)
            heapq.heappush(self._running, (seq.tag, self._joins, seq))
            self._new.append(seq)
        self._report()

    def _report(self) -> None:
        if self._on_occupancy is not None:
            self._on_occupancy(self.env.now, self.reserved_tokens / self.capacity_tokens if self.capacity_tokens else 1.0)

    def _reschedule(self) -> None:
        self._version += 1
        running = self._running
        self._computing(bool(running))
        if not running:
            self._step = 0.0
            self._new.clear()
            return
        self._alone_step = self.cost.decode_step_s(len(running), int(self._base_sum + len(running) * self._clock))
        self._step = self._alone_step * self._sharing_factor()
        for seq in self._new:  # first tokens: one step after joining
            call_later(self.env, self._step, lambda _e, ev=seq.first: fire(ev) if not ev.triggered else None)
        self._new.clear()
        self._wake_at_first_finish()

    def _wake_at_first_finish(self) -> None:
        wait = max(0.0, (self._running[0][0] - self._clock) / self.tokens_per_step * self._step)
        call_later(self.env, wait, self._wake_cb, self._version)

    def _sharing_factor(self) -> float:
        return 1.0 if self.placement is None else self.placement.factor()

    def _computing(self, running: bool) -> None:
        """Tell the devices this instance shares whether it computes (it steps while it has a batch)."""
        placement = self.placement
        if placement is None or placement.computing == running:
            return
        if running:
            placement.start()
        else:
            placement.stop()

    def _devices_changed(self) -> None:
        """Another worker on this instance's devices started or stopped: the batch steps at the new rate from now."""
        if not self._running:
            return
        self._advance()
        self._version += 1
        self._step = self._alone_step * self._sharing_factor()
        self._wake_at_first_finish()

    def _finish(self, seq: _Seq) -> None:
        self.reserved_tokens -= seq.reserved
        self._base_sum -= seq.base

    def _wake(self, ev: simpy.Event) -> None:
        if ev.value != self._version:  # a later reschedule superseded this wake-up
            return
        self._advance()
        running = self._running
        # the wake-up was set for the first finish: it is due even if rounding left it a hair short
        done = [heapq.heappop(running)[2]]
        self._finish(done[0])
        while running and running[0][0] - self._clock <= 1e-6:
            done.append(heapq.heappop(running)[2])
            self._finish(done[-1])
        self._admit()
        self._reschedule()
        for seq in done:  # completed now, once the batch is consistent (callbacks may call generate)
            if not seq.first.triggered:
                fire(seq.first)
            fire(seq.done)
