"""The normalized workload model: sessions -> threads -> requests.

Contract:
    * A :class:`Session` is one recorded agent session (one Weka trace, or one Mooncake row). It
      holds threads (thread 0 is the main agent, the others are subagents) and requests in
      recorded time order (``Request.index`` is the position in that order).
    * Every :class:`Request` carries its recorded start ``t_s`` (absolute session time), input and
      output tokens, the recorded server time, and its dependencies (:class:`Dep`): the previous
      request of its thread (``prev``), the parent turn that spawned its thread (``spawn``, first
      request of a subagent only) and the last requests of the subagent threads it waits for
      (``join``). Each dependency carries the recorded end-to-start gap after it, so a replay
      releases a request at ``max(dep finished live + dep.gap_s)`` over its dependencies.
    * Block hash ids (one id per ``block_tokens`` tokens of the prompt) are stored compactly: each
      request keeps only the ids past its longest common prefix with the previous request of its
      thread, plus a full copy every ``KEYFRAME_EVERY`` requests of a thread. ``Session.block_ids(i)``
      rebuilds the full list as a numpy array. ``hash_scope`` says whether ids are local to the
      session (Weka ``"local"``) or shared by every session of the workload (Mooncake, ``"global"``).

Everything is a plain value: no SimPy, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

DepKind = Literal["prev", "spawn", "join"]
HashScope = Literal["local", "global"]

#: A thread stores the full block id list of one request in this many (bounds rebuild depth).
KEYFRAME_EVERY = 64


@dataclass(frozen=True, slots=True)
class Dep:
    """``request`` (a session index) must finish, then ``gap_s`` pass, before the dependent starts."""

    kind: DepKind
    request: int
    gap_s: float


@dataclass(frozen=True, slots=True)
class Request:
    """One model call as recorded.

    Attributes:
        index: position in the session's time order.
        thread: thread index in the session (0 = main agent).
        seq: position in its thread.
        t_s: recorded start, seconds from the session start.
        in_tokens: prompt length in tokens.
        out_tokens: recorded output length in tokens.
        api_time_s: recorded server time (start to last token), seconds.
        think_time_s: recorded client-side gap before the request (informational; replay uses deps).
        deps: what must finish before this request may start, with the recorded gaps.
        source: where the request came from in its file, e.g. ``requests[12].requests[3]``.
    """

    index: int
    thread: int
    seq: int
    t_s: float
    in_tokens: int
    out_tokens: int
    api_time_s: float
    think_time_s: float
    deps: tuple[Dep, ...]
    source: str

    @property
    def end_s(self) -> float:
        """Recorded end: start + server time."""
        return self.t_s + self.api_time_s


@dataclass(frozen=True, slots=True)
class Thread:
    """One agent thread: the main agent (index 0, parent None) or a subagent.

    Attributes:
        index: thread index in the session.
        parent: parent thread index (None for main).
        spawn_request: session index of the parent turn that spawned it (None for main).
        join_request: session index of the parent turn that waits for it; None when it runs in the
            background (no later parent turn starts at or after its recorded end) or for main.
        requests: session indices of its requests, in order.
        agent_id: the recorded agent id (``"main"`` for thread 0).
        agent_type: recorded ``subagent_type`` (``"main"`` for thread 0).
    """

    index: int
    parent: int | None
    spawn_request: int | None
    join_request: int | None
    requests: tuple[int, ...]
    agent_id: str
    agent_type: str

    @property
    def background(self) -> bool:
        """A subagent that no parent turn waits for."""
        return self.parent is not None and self.join_request is None


@dataclass(frozen=True, slots=True)
class BlockStore:
    """Compact per-session block ids: prefix references plus tails (see module docstring).

    ``ref[i]`` is the session index whose first ``lcp[i]`` ids request ``i`` shares (-1: none),
    ``tail[off[i]:off[i]+n_blocks[i]-lcp[i]]`` are its remaining ids. ``prev_lcp[i]`` is the
    common prefix with the previous request of its thread (0 for a thread's first request), also
    where ``i`` is a keyframe.
    """

    ref: np.ndarray
    lcp: np.ndarray
    off: np.ndarray
    n_blocks: np.ndarray
    tail: np.ndarray
    prev_lcp: np.ndarray

    def block_ids(self, i: int, known: Mapping[int, np.ndarray] | None = None) -> np.ndarray:
        """The full block id list of request ``i`` (a fresh array). ``known``: block id lists of
        other requests the caller already has (by request index); the walk along the prefix
        references stops at the first of them."""
        return self.block_ids_from(i, known)[0]

    def block_ids_from(self, i: int, known: Mapping[int, np.ndarray] | None = None) -> tuple[np.ndarray, int, int]:
        """``block_ids(i, known)`` and where its leading ids came from: ``(ids, r, n)`` when
        its first ``n`` ids are ``known[r]``'s first ``n`` (``(ids, -1, 0)``: none were)."""
        pieces, r, n = self.pieces_from(i, known)
        tail = self.tail
        out = np.empty(int(self.n_blocks[i]), dtype=tail.dtype)
        if n:
            out[:n] = known[r][:n]
        for at, start, count in pieces:
            out[at:at + count] = tail[start:start + count]
        return out, r, n

    def pieces_from(self, i: int, known: Mapping[int, np.ndarray] | None = None,
                    lists: tuple[list[int], list[int], list[int], list[int]] | None = None
                    ) -> tuple[list[tuple[int, int, int]], int, int]:
        """Where request ``i``'s block ids come from, without building them: ``(pieces, r, n)``:
        its first ``n`` ids are ``known[r]``'s first ``n`` (``r, n = -1, 0``: none are), and
        each ``(at, start, count)`` of ``pieces`` puts ``tail[start:start + count]`` at
        ``at`` (together they cover ``n .. n_blocks[i]``, last piece first). ``lists``: this
        store's ``lists()``, for a caller that walks often (list items cost less than numpy
        scalars)."""
        ref, lcps, offs, n_blocks = lists if lists is not None else (self.ref, self.lcp, self.off, self.n_blocks)
        need = int(n_blocks[i])
        pieces = []
        r = i
        while need > 0:
            if known and r != i:
                got = known.get(r)
                if got is not None:  # its first `need` ids are this request's
                    return pieces, r, need
            lcp = int(lcps[r])
            if need > lcp:
                pieces.append((lcp, int(offs[r]), need - lcp))
                need = lcp
            r = int(ref[r])
        return pieces, -1, 0

    def lists(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """``ref``, ``lcp``, ``off`` and ``n_blocks`` as lists of ints (a fresh copy)."""
        return self.ref.tolist(), self.lcp.tolist(), self.off.tolist(), self.n_blocks.tolist()

    def nbytes(self) -> int:
        """Memory held by the arrays."""
        return sum(a.nbytes for a in (self.ref, self.lcp, self.off, self.n_blocks, self.tail, self.prev_lcp))


class BlockStoreBuilder:
    """Builds a :class:`BlockStore` request by request (in session index order)."""

    def __init__(self) -> None:
        self._ref: list[int] = []
        self._lcp: list[int] = []
        self._off: list[int] = []
        self._n: list[int] = []
        self._tails: list[np.ndarray] = []
        self._prev_lcp: list[int] = []
        self._total = 0

    def add(self, ref: int, lcp: int, tail: np.ndarray, n_blocks: int, prev_lcp: int | None = None) -> None:
        """Append the next request: ``lcp`` ids shared with request ``ref``, then ``tail``."""
        self._prev_lcp.append(lcp if prev_lcp is None else prev_lcp)
        self._ref.append(ref)
        self._lcp.append(lcp)
        self._off.append(self._total)
        self._n.append(n_blocks)
        self._tails.append(tail)
        self._total += len(tail)

    def build(self) -> BlockStore:
        tails = [t for t in self._tails if len(t)]
        tail = np.concatenate(tails) if tails else np.zeros(0, dtype=np.uint32)
        if len(tail):
            tail = tail.astype(np.uint32 if int(tail.max()) < 2**32 else np.uint64, copy=False)
        return BlockStore(
            ref=np.asarray(self._ref, dtype=np.int32),
            lcp=np.asarray(self._lcp, dtype=np.int32),
            off=np.asarray(self._off, dtype=np.int64),
            n_blocks=np.asarray(self._n, dtype=np.int32),
            tail=tail,
            prev_lcp=np.asarray(self._prev_lcp, dtype=np.int32),
        )


@dataclass(frozen=True, slots=True)
class Session:
    """One recorded session (a trace): threads and time-ordered requests.

    Attributes:
        id: the trace id.
        block_tokens: tokens per hash block (64 Weka, 512 Mooncake).
        hash_scope: ``"local"`` (ids private to this session) or ``"global"``.
        threads: main thread first.
        requests: all requests (main and subagents) in recorded time order.
        blocks: the compact block ids (``block_ids(i)``).
        models: models named in the trace.
        source: the file (and line) it came from.
        dropped_subagents: subagent entries dropped because no parent turn preceded them.
    """

    id: str
    block_tokens: int
    hash_scope: HashScope
    threads: tuple[Thread, ...]
    requests: tuple[Request, ...]
    blocks: BlockStore
    models: tuple[str, ...] = ()
    source: str = ""
    dropped_subagents: int = 0

    def block_ids(self, i: int) -> np.ndarray:
        """Block hash ids of request ``i`` (one per ``block_tokens`` tokens of its prompt)."""
        return self.blocks.block_ids(i)

    @property
    def start_s(self) -> float:
        return self.requests[0].t_s if self.requests else 0.0

    @property
    def end_s(self) -> float:
        """Recorded end of the last request."""
        return max((r.end_s for r in self.requests), default=0.0)

    @property
    def span_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def peak_context_tokens(self) -> int:
        """Largest ``in + out`` over all requests (the ``--max-context-length`` criterion)."""
        return max((r.in_tokens + r.out_tokens for r in self.requests), default=0)

    @property
    def main(self) -> Thread:
        return self.threads[0]

    def thread_requests(self, thread: int) -> list[Request]:
        return [self.requests[i] for i in self.threads[thread].requests]


@dataclass(frozen=True, slots=True)
class SkippedTrace:
    """A trace left out by ``skip_bad``: where and why."""

    file: str
    trace_id: str | None
    request: str | None
    message: str


@dataclass(frozen=True)
class Workload:
    """A set of sessions plus what loading left out."""

    sessions: tuple[Session, ...]
    skipped: tuple[SkippedTrace, ...] = field(default=())

    def __len__(self) -> int:
        return len(self.sessions)

    def __iter__(self) -> Iterator[Session]:
        return iter(self.sessions)

    @property
    def n_requests(self) -> int:
        return sum(len(s.requests) for s in self.sessions)

    def by_id(self, trace_id: str) -> Session:
        for s in self.sessions:
            if s.id == trace_id:
                return s
        raise KeyError(trace_id)

    def subset(self, ids: Sequence[str]) -> Workload:
        want = set(ids)
        return Workload(tuple(s for s in self.sessions if s.id in want), self.skipped)
