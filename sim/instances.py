"""Prefill and decode instances as SimPy actors.

Prefill (``PrefillInstance``): chunked prefill in steps of at most ``max_batched_tokens`` tokens,
FIFO over the requests whose KV is ready; with PP the stages overlap, so a step takes the cost
model's time for the whole pipeline's work per stage share, and a request's last chunk completes
``pp - 1`` step times after its step (the pipeline fill). Per stage, pool loads run on
``load_workers_per_stage`` load workers (ATOM's default is one), each stage starting its load
after the forwards queued ahead of it.

Decode (``DecodeInstance``): continuous batching as a fluid model. Between joins and leaves the
step time is constant (cost model of the running batch), every sequence advances
``mtp_accept_tokens`` tokens per step; the next event is the first sequence to finish. A request
joins when its KV fits (``in + out`` tokens reserved of the instance's KV capacity) and the batch
has room (``max_seqs``); its first token comes one step after it joins.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import simpy

from kvpool.sim.cost import CostModel
from kvpool.sim.gpucache import GPUPrefixCache


class Workers:
    """``capacity`` workers serving jobs first come, first served, without SimPy processes.

    ``submit(start)`` calls ``start()`` as soon as a worker is free (at once when one is); the job
    calls ``release()`` when it is done, which starts the next queued job at that moment."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"workers: capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.busy = 0
        self._queue: deque[Callable[[], None]] = deque()

    @property
    def queued(self) -> int:
        return len(self._queue)

    def submit(self, start: Callable[[], None]) -> None:
        if self.busy < self.capacity:
            self.busy += 1
            start()
        else:
            self._queue.append(start)

    def release(self) -> None:
        if self._queue:
            self._queue.popleft()()
        else:
            self.busy -= 1


@dataclass
class _Compute:
    remaining: int
    context: int
    done: simpy.Event


class PrefillInstance:
    def __init__(self, env: simpy.Environment, index: int, server: int, gpus: list[int], *, pp: int, tp: int,
                 max_batched_tokens: int, cost: CostModel, cache: GPUPrefixCache, load_workers: int) -> None:
        self.env = env
        self.index = index
        self.server = server
        self.gpus = gpus
        self.pp = pp
        self.tp = tp
        self.max_batched_tokens = max_batched_tokens
        self.cost = cost
        self.cache = cache
        self.loaders = [Workers(load_workers) for _ in range(pp * tp)]
        self.outstanding_tokens = 0
        self.step_s = 0.0
        self.busy_s = 0.0
        self.computed_tokens = 0
        self._queue: deque[_Compute] = deque()
        self._kick = env.event()
        env.process(self._run())

    @property
    def ranks(self) -> int:
        return self.pp * self.tp

    def rank_gpu(self, rank: int) -> int:
        return self.gpus[rank % len(self.gpus)]

    def queued_tokens(self) -> int:
        return sum(c.remaining for c in self._queue)

    def compute(self, tokens: int, context: int) -> simpy.Event:
        """An event that succeeds when ``tokens`` tokens after ``context`` cached ones are computed."""
        done = self.env.event()
        if tokens <= 0:
            done.succeed()
            return done
        self._queue.append(_Compute(tokens, context, done))
        if not self._kick.triggered:
            self._kick.succeed()
        return done

    def _run(self):
        env = self.env
        while True:
            if not self._queue:
                self._kick = env.event()
                self.step_s = 0.0
                yield self._kick
                continue
            budget = self.max_batched_tokens
            batch: list[tuple[_Compute, int]] = []
            for c in self._queue:
                if budget <= 0:
                    break
                take = min(c.remaining, budget)
                batch.append((c, take))
                budget -= take
            step = self.cost.prefill_step_s([(take, c.context) for c, take in batch])
            self.step_s = step
            yield env.timeout(step)
            self.busy_s += step
            for c, take in batch:
                c.remaining -= take
                c.context += take
                self.computed_tokens += take
                if c.remaining == 0:
                    self._queue.remove(c)
                    fill = (self.pp - 1) * step
                    if fill > 0:
                        env.timeout(fill).callbacks.append(lambda _e, d=c.done: d.succeed())
                    else:
                        c.done.succeed()


@dataclass
class _Seq:
    remaining: float
    context: int
    reserved: int
    first: simpy.Event
    done: simpy.Event
    first_pending: bool = True
    first_at: float = field(default=0.0)


class DecodeInstance:
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
        self._running: list[_Seq] = []
        self._waiting: deque[tuple[int, int, int, simpy.Event, simpy.Event]] = deque()
        self._last = env.now
        self._version = 0
        self._step = 0.0
        self._on_occupancy = on_occupancy

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.reserved_tokens

    @property
    def running(self) -> int:
        return len(self._running)

    def kv_tokens(self) -> int:
        return sum(s.context for s in self._running)

    def generate(self, in_tokens: int, out_tokens: int) -> tuple[simpy.Event, simpy.Event]:
        """(first token, finished) events for a request whose KV has arrived."""
        first, done = self.env.event(), self.env.event()
        self._waiting.append((in_tokens, max(1, out_tokens), in_tokens + max(1, out_tokens), first, done))
        self._advance()
        self._admit()
        self._reschedule()
        return first, done

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self._last
        if dt > 0 and self._running and self._step > 0:
            made = dt / self._step * self.tokens_per_step
            for s in self._running:
                s.remaining -= made
                s.context += int(made)
        self._last = now

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self.max_seqs:
            inp, out, need, first, done = self._waiting[0]
            if need > self.free_tokens and self._running:
                break
            self._waiting.popleft()
            self.reserved_tokens += need
            self._running.append(_Seq(float(out), inp, need, first, done))
        self._report()

    def _report(self) -> None:
        if self._on_occupancy is not None:
            self._on_occupancy(self.env.now, self.reserved_tokens / self.capacity_tokens if self.capacity_tokens else 1.0)

    def _reschedule(self) -> None:
        self._version += 1
        if not self._running:
            self._step = 0.0
            return
        ctx = sum(s.context for s in self._running)
        self._step = self.cost.decode_step_s(len(self._running), ctx)
        # first tokens: one step after joining
        waits = []
        for s in self._running:
            if s.first_pending:
                s.first_pending = False
                self.env.timeout(self._step).callbacks.append(lambda _e, ev=s.first: ev.succeed() if not ev.triggered else None)
        soonest = min(s.remaining for s in self._running)
        wait = max(0.0, soonest / self.tokens_per_step * self._step)
        waits.append(wait)
        version = self._version
        self.env.timeout(min(waits)).callbacks.append(lambda _e: self._wake(version))

    def _wake(self, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        still = []
        for s in self._running:
            if s.remaining <= 1e-6:
                self.reserved_tokens -= s.reserved
                if not s.first.triggered:
                    s.first.succeed()
                s.done.succeed()
            else:
                still.append(s)
        if len(still) == len(self._running):
            still.sort(key=lambda s: s.remaining)
            s = still.pop(0)
            self.reserved_tokens -= s.reserved
            if not s.first.triggered:
                s.first.succeed()
            s.done.succeed()
        self._running = still
        self._admit()
        self._reschedule()
