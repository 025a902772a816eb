"""The simulated Mooncake Store pool: parts (one master each), where each stage's objects live.

Contract:
    * The pool is split into ``pool.parts`` parts (the seed's four RoCE rails; one part on the
      single server). Stage ``s`` of a prefill instance reads and writes part ``s mod parts``; a
      part holds, per chunk group, the objects of the stages mapped to it (``policy.grouptable``
      evicts them together; with four parts each stage is evicted by its own master, so a chunk
      can be held by some stages only).
    * ``shared`` mode: one set of parts for the whole cluster, capacity = all servers' services.
      ``split`` mode: each server has its own parts holding only its services' memory, used only
      by the prefill instances on that server.
    * A prefill instance with TP ranks saves one copy per rank (the MLA latent is replicated);
      rank ``r`` of stage ``s`` is rank index ``s * tp + r`` and uses part ``index mod parts``.
    * Optional SSD tier: groups evicted from DRAM demote there (its own ``GroupTable``);
      a chunk found only on SSD is restored at SSD bandwidth and promoted back.
    * Every call names its chunk groups as one ``GroupIds`` (a prompt's, ``Prompt.groups``, or a
      part of them): distinct and bounded by construction, so no table checks either.
"""

from __future__ import annotations

import numpy as np

from kvpool.policy.grouptable import GroupIds, GroupTable
from kvpool.scenario.derive import GIB, pool_capacity_bytes
from kvpool.scenario.model import Scenario


class SimPool:
    def __init__(self, s: Scenario, chunk_object_bytes: list[int]) -> None:
        """``chunk_object_bytes[rank]`` is the size of one chunk object of prefill rank ``rank``."""
        p = s.pool
        self.scenario = s
        self.parts = p.parts
        self.mode = p.mode
        self.servers = s.cluster.servers
        ranks = len(chunk_object_bytes)
        self.rank_part = [r % p.parts for r in range(ranks)]
        # slots of each part: the ranks mapped to it, in rank order
        self.part_ranks = [[r for r in range(ranks) if self.rank_part[r] == q] for q in range(p.parts)]
        total = pool_capacity_bytes(s)
        groups = 1 if p.mode == "shared" else self.servers
        per_table = total // (groups * p.parts)
        self.tables: list[list[GroupTable]] = []
        for _ in range(groups):
            row = []
            for q in range(p.parts):
                sizes = [chunk_object_bytes[r] for r in self.part_ranks[q]] or [1]
                row.append(GroupTable(per_table, sizes, p.eviction_policy,
                                      high_watermark=p.high_watermark, evict_ratio=p.evict_ratio))
            self.tables.append(row)
        self._all_tables = [t for row in self.tables for t in row]  # fixed from here on
        self._parts_memo: dict[int, list[tuple[int, list[int], list[int]]]] = {}
        self.ssd: list[GroupTable] | None = None
        if p.ssd.enabled and p.ssd.gib_per_server > 0:
            ssd_total = int(p.ssd.gib_per_server * GIB * self.servers)
            ssd_groups = 1 if p.mode == "shared" else self.servers
            self.ssd = [GroupTable(ssd_total // ssd_groups, [sum(chunk_object_bytes)], p.eviction_policy,
                                   high_watermark=p.high_watermark, evict_ratio=p.evict_ratio)
                        for _ in range(ssd_groups)]

    @property
    def capacity_bytes(self) -> int:
        return sum([t.capacity_bytes for t in self._all_tables])

    @property
    def used_bytes(self) -> int:
        tables = self._all_tables  # one table (one server, one part): read directly
        return tables[0].used_bytes if len(tables) == 1 else sum([t.used_bytes for t in tables])

    @property
    def evicted_groups(self) -> int:
        tables = self._all_tables  # one table (one server, one part): read directly
        return tables[0].evicted_groups if len(tables) == 1 else sum([t.evicted_groups for t in tables])

    def _group(self, server: int) -> int:
        return 0 if self.mode == "shared" else server

    def lookup(self, server: int, ranks: int, gids: GroupIds, now: float) -> np.ndarray:
        """Presence ``[rank, chunk]`` of every rank's object for each chunk: one batched check per
        part (rank ``r`` is row ``r``)."""
        row = self.tables[self._group(server)]
        parts = self._parts_of(ranks)
        if len(parts) == 1 and parts[0][2] == list(range(ranks)):  # one part holds every rank, in order
            q, slots, _ = parts[0]
            return row[q].lookup_slots(gids, slots, now)
        out = np.zeros((ranks, gids.ids.size), dtype=bool)
        for q, slots, mine in parts:
            out[mine] = row[q].lookup_slots(gids, slots, now)
        return out

    def lookup_runs(self, server: int, ranks: int, gids: GroupIds, now: float) -> list[int]:
        """Per rank, how many leading chunks of ``gids`` hold its object: the leading runs of
        ``lookup``'s rows (same recency), without building them."""
        row = self.tables[self._group(server)]
        parts = self._parts_of(ranks)
        if len(parts) == 1:
            return row[parts[0][0]].lookup_runs(gids, parts[0][1], now)  # ranks in slot order
        out = [0] * ranks
        for q, slots, mine in parts:
            for r, run in zip(mine, row[q].lookup_runs(gids, slots, now)):
                out[r] = run
        return out

    def _parts_of(self, ranks: int) -> list[tuple[int, list[int], list[int]]]:
        """(part, slots, ranks) of every part that ranks ``0 .. ranks-1`` use, memoized."""
        got = self._parts_memo.get(ranks)
        if got is None:
            got = []
            for q, members in enumerate(self.part_ranks):
                mine = [r for r in members if r < ranks]
                if mine:
                    got.append((q, [members.index(r) for r in mine], mine))
            self._parts_memo[ranks] = got
        return got

    def ssd_lookup(self, server: int, gids: GroupIds, now: float) -> np.ndarray | None:
        if self.ssd is None:
            return None
        return self.ssd[self._group(server)].lookup(gids, 0, now)

    def save(self, server: int, ranks: int, gids: GroupIds, now: float) -> None:
        """Put every rank's objects of ``gids`` (one batched put per part); groups evicted from
        DRAM demote to the SSD tier when there is one."""
        g = self._group(server)
        for q, slots, _ in self._parts_of(ranks):
            out = self.tables[g][q].put(gids, slots, now)
            if self.ssd is not None and out.evicted_ids.size:
                self.ssd[g].put(out.evicted_ids, 0, now)

    def _tables_of(self, server: int, ranks: int) -> list[GroupTable]:
        """The distinct tables that ranks ``0 .. ranks-1`` of an instance on ``server`` use."""
        row = self.tables[self._group(server)]
        return [row[q] for q, _, _ in self._parts_of(ranks)]

    def pin(self, server: int, ranks: int, gids: GroupIds) -> None:
        """Protect the groups of ``gids`` in every part the instance's ranks use (loads in flight)."""
        for t in self._tables_of(server, ranks):
            t.pin(gids)

    def unpin(self, server: int, ranks: int, gids: GroupIds) -> None:
        for t in self._tables_of(server, ranks):
            t.unpin(gids)
