"""One request's prefill lifecycle: what it loads, computes and saves, and what its record says.

Both worlds run every request through one ``PrefillRequest``: the simulator (``sim.steps.lookup``
makes it, ``sim.lifecycle`` reports the restore, the compute and the hand-off and waits for
``ended``, ``sim.steps.save`` reports the save) and the backend
(``backend.connector_scheduler.ConnectorScheduler`` keeps one per request; the prefill engine,
``backend.serve.prefill_scheduler``, and ``backend.connector.StageAlignedConnector`` read its
compute ranges and record fields). The drivers keep their clocks, threads and sockets;
the decisions below are made here and nowhere else.

Events, in the order a request meets them (a call out of order raises ``PrefillOrderError``):
    ``looked_up(hit, answered)``  ``policy.hits``' split of the prompt and whether the pool
                                  answered; returns the load to run (``None``: none). It may come
                                  again before the load's outcome (a stale lookup re-checked):
                                  the latest decides.
    ``loaded(ok)``                the load's outcome, all stages or none: a stage that failed,
                                  or a load only some stages finished, is ``ok=False``.
    ``computed(kv_tokens)``       prefill computed its ranges: the KV of the first ``kv_tokens``
                                  exists (default the whole prompt; it may grow in later calls).
    ``start_save(keyed_chunks)``  the save to run now (``None``: nothing new, or one in flight).
    ``saved(stored)``             that save ended, stored on every stage or not.
    ``handed_off()``              the hand-off to decode ended (done or failed).

Rules (chunks of ``chunk_tokens``; token ranges ``(start, end)``, end exclusive):
    * **Load**: chunks ``[hit.load_first_chunk, hit.load_end_chunk)`` when the pool answered and
      ``hit.pool_tokens > 0``; else none.
    * **Compute ranges**: after a successful load ``(gpu, first_chunk x chunk_tokens)`` when not
      empty, then ``(first_chunk x chunk_tokens + pool_tokens, prompt)``: a full-prompt hit
      leaves its last token to compute. Without a successful load (none, or one that failed)
      ``(gpu, prompt)``: a failed load recomputes from the last prefix every stage holds, the
      GPU hit. The ranges' lengths sum to ``computed_tokens``.
    * **Save floor** (``save_floor_chunks``): the chunks the pool held on every stage at the
      latest answered lookup (``hit.pool_prefix_chunks``) are not saved again; a failed load
      lowers the floor to the load's first chunk, so the recomputed chunks are saved; a stored
      save raises it to the save's end; a save not stored leaves it (a later save tries again).
    * **Save**: chunks ``[floor, min(keyed_chunks, kv_tokens // chunk_tokens))`` (full chunks of
      computed KV that have a key), one save in flight at a time.
    * **Record fields** (``account``, ``PrefillAccount``): ``gpu_tokens`` is the GPU hit;
      ``pool_tokens`` the load's tokens (the planned load's until its outcome, 0 after a failed
      one or without a load); ``computed_tokens`` the rest of the prompt; ``restore_failed``
      whether the load failed; ``lookup_answered`` whether the latest lookup was answered.
    * ``ended``: the hand-off ended and no save is in flight (the request's pages may go).

No clock, no I/O, no randomness: the same events give the same answers in both worlds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from kvpool.policy.hits import HitResult

#: A token range ``(start, end)``, end exclusive.
TokenRange = tuple[int, int]


class PrefillOrderError(ValueError):
    """An event came in an order the lifecycle does not allow (a driver's bug)."""


class Phase(enum.Enum):
    """Where a request is in its prefill."""

    NEW = "new"                # not looked up yet
    LOOKED_UP = "looked_up"    # its hit is known; its load, if it has one, has not ended
    LOAD_ENDED = "load_ended"  # its load ended (``load_ok``)
    COMPUTED = "computed"      # prefill computed its ranges (``kv_tokens`` of KV exist)


class ChunkRange(NamedTuple):
    """Chunks ``first_chunk .. end_chunk - 1`` of a prompt."""

    first_chunk: int
    end_chunk: int

    @property
    def chunks(self) -> int:
        return self.end_chunk - self.first_chunk


class TokenRecord(Protocol):
    """The fields of ``kvpool.workload.records.RequestRecord`` that ``PrefillAccount.write`` sets."""

    gpu_tokens: int
    pool_tokens: int
    ssd_tokens: int
    computed_tokens: int
    restore_failed: bool
    lookup_answered: bool


@dataclass(frozen=True, slots=True)
class PrefillAccount:
    """A request's record fields as its prefill events decide them (see the module docstring);
    ``gpu_tokens + pool_tokens + computed_tokens`` is the prompt."""

    gpu_tokens: int
    pool_tokens: int
    computed_tokens: int
    restore_failed: bool
    lookup_answered: bool

    def write(self, rec: TokenRecord, ssd_tokens: int = 0) -> None:
        """Set ``rec``'s fields; ``ssd_tokens`` of the pool tokens came from an SSD tier (the
        simulator's, ``sim.steps.restore``): they count as ``rec.ssd_tokens``, at most the pool
        tokens (none after a failed load)."""
        ssd = min(ssd_tokens, self.pool_tokens)
        rec.gpu_tokens = self.gpu_tokens
        rec.pool_tokens = self.pool_tokens - ssd
        rec.ssd_tokens = ssd
        rec.computed_tokens = self.computed_tokens
        rec.restore_failed = self.restore_failed
        rec.lookup_answered = self.lookup_answered


class PrefillRequest:
    """One request's prefill state machine (see the module docstring).

    Args:
        prompt_tokens: the prompt's length.
        chunk_tokens: tokens per pool chunk.

    Attributes (read them; only the events change them):
        phase: where the request is.
        hit: the latest lookup's split (``None`` before the first).
        lookup_answered: whether the latest lookup was answered.
        load: the chunks to load (``None``: no load).
        load_ok: the load's outcome (``None`` until it ended, or without a load).
        kv_tokens: the prompt's tokens whose KV exists after compute.
        save_floor_chunks: the first chunk a save may start at.
        save_in_flight: the save under way (``None``: none).
        handoff_ended: whether the hand-off ended.
    """

    __slots__ = ("prompt_tokens", "chunk_tokens", "phase", "hit", "lookup_answered", "load", "load_ok",
                 "kv_tokens", "save_floor_chunks", "save_in_flight", "handoff_ended")

    def __init__(self, prompt_tokens: int, chunk_tokens: int) -> None:
        if prompt_tokens < 0:
            raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
        self.prompt_tokens = prompt_tokens
        self.chunk_tokens = chunk_tokens
        self.phase = Phase.NEW
        self.hit: HitResult | None = None
        self.lookup_answered = False
        self.load: ChunkRange | None = None
        self.load_ok: bool | None = None
        self.kv_tokens = 0
        self.save_floor_chunks = 0
        self.save_in_flight: ChunkRange | None = None
        self.handoff_ended = False

    # -- events ----------------------------------------------------------------------------
    def looked_up(self, hit: HitResult, answered: bool) -> ChunkRange | None:
        """The pool's answer (``answered=False``: none; then nothing loads); returns the load to run."""
        if self.phase not in (Phase.NEW, Phase.LOOKED_UP):
            raise PrefillOrderError(f"a lookup after the load ended or the prompt was computed ({self.phase.value})")
        if hit.prompt_tokens != self.prompt_tokens:
            raise ValueError(f"the hit splits {hit.prompt_tokens} tokens, the prompt has {self.prompt_tokens}")
        self.phase = Phase.LOOKED_UP
        self.hit = hit
        self.lookup_answered = answered
        if answered:
            self.save_floor_chunks = hit.pool_prefix_chunks
        self.load = ChunkRange(hit.load_first_chunk, hit.load_end_chunk) if answered and hit.pool_tokens else None
        return self.load

    def loaded(self, ok: bool) -> PrefillAccount:
        """The load ended on every stage (``ok``) or not; returns the record fields now."""
        if self.phase is not Phase.LOOKED_UP or self.load is None:
            raise PrefillOrderError(f"a load outcome without a load under way ({self.phase.value})")
        self.phase = Phase.LOAD_ENDED
        self.load_ok = ok
        if not ok:  # the recomputed chunks are saved again
            self.save_floor_chunks = min(self.save_floor_chunks, self.load.first_chunk)
        return self.account

    def computed(self, kv_tokens: int | None = None) -> None:
        """Prefill computed: the KV of the prompt's first ``kv_tokens`` exists (default: all of it)."""
        if not self.ready_to_compute:
            raise PrefillOrderError(f"computed before the lookup or before its load ended ({self.phase.value})")
        kv = self.prompt_tokens if kv_tokens is None else kv_tokens
        if not self.kv_tokens <= kv <= self.prompt_tokens:
            raise ValueError(f"kv_tokens {kv} must be in [{self.kv_tokens}, {self.prompt_tokens}]")
        self.phase = Phase.COMPUTED
        self.kv_tokens = kv

    def start_save(self, keyed_chunks: int) -> ChunkRange | None:
        """The chunks to save now, of the prompt's first ``keyed_chunks`` (those with a key);
        ``None`` when none is new or a save is in flight."""
        if self.phase is not Phase.COMPUTED:
            raise PrefillOrderError(f"a save before the prompt was computed ({self.phase.value})")
        if self.save_in_flight is not None:
            return None
        end = min(keyed_chunks, self.kv_tokens // self.chunk_tokens)
        if end <= self.save_floor_chunks:
            return None
        self.save_in_flight = ChunkRange(self.save_floor_chunks, end)
        return self.save_in_flight

    def saved(self, stored: bool) -> None:
        """The save in flight ended: ``stored`` on every stage (the floor rises past it) or not."""
        save = self.save_in_flight
        if save is None:
            raise PrefillOrderError("no save in flight for this request")
        if stored:
            self.save_floor_chunks = max(self.save_floor_chunks, save.end_chunk)
        self.save_in_flight = None

    def handed_off(self) -> None:
        """The hand-off to decode ended (done or failed)."""
        if self.phase is not Phase.COMPUTED:
            raise PrefillOrderError(f"a hand-off before the prompt was computed ({self.phase.value})")
        self.handoff_ended = True

    # -- answers ---------------------------------------------------------------------------
    @property
    def ready_to_compute(self) -> bool:
        """Looked up, and its load (if any) ended."""
        return self.phase in (Phase.LOAD_ENDED, Phase.COMPUTED) or (self.phase is Phase.LOOKED_UP and self.load is None)

    @property
    def compute_ranges(self) -> tuple[TokenRange, ...]:
        """The token ranges prefill computes, in order (see the module docstring)."""
        if not self.ready_to_compute:
            raise PrefillOrderError(f"compute ranges before the lookup or before its load ended ({self.phase.value})")
        hit, n = self.hit, self.prompt_tokens
        gpu = hit.gpu_tokens
        if self.load_ok:
            load_start = self.load.first_chunk * self.chunk_tokens
            ranges = ((gpu, load_start), (load_start + hit.pool_tokens, n))
        else:
            ranges = ((gpu, n),)
        return tuple(r for r in ranges if r[0] < r[1])

    @property
    def account(self) -> PrefillAccount:
        """The record fields the events so far decide (see the module docstring)."""
        hit = self.hit
        if hit is None:
            raise PrefillOrderError("record fields before the lookup")
        pool = hit.pool_tokens if self.load is not None and self.load_ok is not False else 0
        return PrefillAccount(hit.gpu_tokens, pool, self.prompt_tokens - hit.gpu_tokens - pool, self.load_ok is False,
                              self.lookup_answered)

    @property
    def ended(self) -> bool:
        """The hand-off ended and no save is in flight."""
        return self.handoff_ended and self.save_in_flight is None


__all__ = ["ChunkRange", "Phase", "PrefillAccount", "PrefillOrderError", "PrefillRequest", "TokenRange", "TokenRecord"]
