"""Triton host functions for the four ops (portable Triton: CUDA and ROCm alike).

Primitives:
    Host functions (validate, then launch; tensors on a GPU compiled, or on the CPU under
    Triton's interpreter, which needs the ``triton`` package but no GPU):
        ``pack_triton``, ``unpack_triton``, ``gather_dcp_triton``, ``scatter_dcp_triton``.
    The kernels behind them live in ``_triton_kernels.py`` (``_copy_rows_kernel``, and
    ``_copy_rows_persistent_kernel`` behind ``PERSIST_CTAS_PER_SM``), loaded by ``_kernel(interpret)``.

Design. Every op moves *rows*: one token's record of one per-layer cache (576 B latent, 144 B
indexer, ...). A row has a paged side (cache base + block id x block stride + slot x token stride)
and a flat side (chunk object or staging buffer). A program copies ``ROWS`` rows of one launch;
a row's words are split into a power-of-two head and a masked power-of-two tail. The block id
is read once per row. Records move as 4-, 2- or 1-byte words, the widest that divides every
address, stride and record size, with ``tl.multiple_of`` hints up to 16 B so loads vectorize.
All addresses are word offsets from one anchor pointer (the first cache), so one launch reaches any
number of caches; per-cache bases and strides sit in a small int64 table cached across calls.
With ``validate=False`` nothing synchronizes, so the ops can be captured in a CUDA graph.

Measured on one H200 (bench/kernels.py, 2026-11-29, cold L2). The ratio is against a device copy
of the same bytes, over the last two runs:
    pack 64 x 256-token chunks of a 20-layer GLM-5.3 stage: 1.87-1.90 TB/s, ratio 0.90-0.91
    unpack of the same: 1.78-1.81 TB/s, ratio 0.86
    128K-token save: 1.99 TB/s; restore: 1.88 TB/s (0.95 and 0.90 of the best copy)
    8,192-token gather to 4 ranks: 1.75-1.81 TB/s, ratio 0.86-0.90
    scatter of one rank's 23.6 MB: 1.46-1.48 TB/s, ratio 0.81-0.82
    scatter of one 8 MiB landed write: ratio 1.05
    one 3.2 MB chunk: ratio 0.73-0.84 (launch-latency bound; ``MIN_PROGRAMS_PER_SM`` spreads small
    launches over every multiprocessor, not measured yet)

Triton is imported only inside ``_kernel``; importing this module needs torch alone.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import sys
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from kvpool.kernels import _checks as ck
from kvpool.kernels.format import ChunkFormat
from kvpool.policy.layout import HandoffPlan

MODE_CHUNK = 0  # pack / unpack: groups are chunks
MODE_GATHER = 1  # gather_dcp: groups are decode ranks, rank buffers back to back
MODE_SCATTER = 2  # scatter_dcp: one rank, a landing slice of its buffer
MODE_SCATTER_SEGS = 3  # ScatterDcp: one rank, several landed slices (one group per slice)

#: Tuning knobs (bench/kernels.py sweeps them): words per program tile, warps per program.
TILE_WORDS = 4096
NUM_WARPS = 4
#: Programs per multiprocessor of the persistent, software-pipelined kernel for single-size
#: launches; 0 (default) uses the one-tile-per-program kernel. Measured on an H200 (bench/kernels.py
#: --sweep, 2026-11-29): persistent 8/SM gave 0.74 of the copy on scatter_8k_rank against 0.83 for
#: one tile per program, and 0.80 against 0.90 on gather_8k_4ranks.
PERSIST_CTAS_PER_SM = 0
#: Pack/unpack of two record sizes (latent + indexer) in one launch (True, default) or one launch
#: per size (False; same sweep: 0.77-0.84 against 0.87-0.92 on the 64-chunk window).
PAIR_RECORD_SIZES = True
#: ``DcpLauncher`` relaunches a kernel it compiled before through the compiled kernel itself,
#: skipping Triton's per-call argument binding (tens of microseconds for this kernel's 34
#: arguments). The cache key holds every property Triton specializes on (each integer's ==1,
#: %16 and 32-bit range, each pointer's dtype and 16-byte alignment, every constexpr), so a hit
#: is always the kernel Triton itself would pick. False: always Triton's own launch path.
FAST_LAUNCH = True
#: Small launches (one chunk, a short turn) fill the GPU with fewer, fatter programs than it has
#: multiprocessors to spare; with this > 0 a compiled launch halves its rows per program (down to
#: ``MIN_TILE_ROWS``) until it has at least this many programs per multiprocessor, so the same
#: bytes are in flight on every multiprocessor. 0: the tile size alone decides. Swept by
#: bench/kernels.py --sweep.
MIN_PROGRAMS_PER_SM = 4
MIN_TILE_ROWS = 2
_SM_COUNT: dict[int, int] = {}
_MAX_GRID_Y = 65535
_KERNELS: dict[bool, Any] = {}
_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()
_TABLES_MAX = 64


def _kernel(interpret: bool) -> Any:
    """Build (once per mode) the row-copy kernel; ``interpret`` selects Triton's CPU interpreter."""
    if interpret in _KERNELS:
        return _KERNELS[interpret]
    with _interpret_env(interpret):
        import triton

        spec = importlib.util.spec_from_file_location(
            f"kvpool.kernels._triton_kernels_{'interpreted' if interpret else 'compiled'}",
            Path(__file__).with_name("_triton_kernels.py"),
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        _KERNELS[interpret] = (module, triton)
    return _KERNELS[interpret]


@contextlib.contextmanager
def _interpret_env(interpret: bool) -> Iterator[None]:
    """Triton reads TRITON_INTERPRET when a kernel is decorated and again inside interpreted
    launches; set it for exactly that span so no other Triton user in the process is affected."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


# ----------------------------------------------------------------------------------------------
# host side


def _use_interpreter(device: torch.device, interpret: bool | None) -> bool:
    """On the CPU the kernels run under Triton's interpreter; on a GPU compiled unless asked."""
    if device.type == "cpu":
        if interpret is False:
            raise RuntimeError("compiled Triton kernels need a GPU; on the CPU use the interpreter or the reference")
        return True
    return bool(interpret)


def _word_bytes(quantities: Sequence[int]) -> tuple[int, int]:
    """(word bytes, alignment in words) for byte quantities: addresses, strides, record sizes."""
    g = 0
    for q in quantities:
        g = math.gcd(g, int(q))
    g = math.gcd(g, 16) if g else 16
    word = 4 if g % 4 == 0 else 2 if g % 2 == 0 else 1
    return word, g // word


def _cache_quantities(caches: Sequence[torch.Tensor]) -> list[int]:
    out = []
    for c in caches:
        es = c.element_size()
        out += [c.data_ptr(), c.stride(0) * es, c.stride(1) * es, c.shape[2] * es]
    return out


def _seg_table(
    caches: Sequence[torch.Tensor], index: Sequence[int], word: int, flat_bytes: Sequence[int]
) -> torch.Tensor:
    """int64 [4, n] table (paged base, block stride, token stride, flat offset) in words, cached."""
    anchor = caches[0].data_ptr()
    sel = [caches[i] for i in index]
    key = (
        caches[0].device,
        anchor,
        word,
        tuple((c.data_ptr(), tuple(c.shape), c.stride(), c.element_size()) for c in sel),
        tuple(flat_bytes),
    )
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    rows: list[list[int]] = [[], [], [], []]
    for c, fb in zip(sel, flat_bytes):
        es = c.element_size()
        rows[0].append((c.data_ptr() - anchor) // word)
        rows[1].append(c.stride(0) * es // word)
        rows[2].append(c.stride(1) * es // word)
        rows[3].append(fb // word)
    table = torch.tensor(rows, dtype=torch.int64).to(caches[0].device)
    _TABLES[key] = table
    if len(_TABLES) > _TABLES_MAX:
        _TABLES.popitem(last=False)
    return table


def tile_rows(rec_words: int, grid_rows: int, groups: int, sm_count: int, min_programs_per_sm: int) -> int:
    """Rows per program: ``TILE_WORDS`` worth of records (a power of two, >= 1, <= the rows), then
    halved down to ``MIN_TILE_ROWS`` while the launch has fewer than ``min_programs_per_sm`` x
    ``sm_count`` programs (``groups`` programs per row tile)."""
    width = 1 << max(0, (rec_words - 1).bit_length())
    rows = max(1, min(max(1, TILE_WORDS // width), 1 << max(0, (max(grid_rows, 1) - 1).bit_length())))
    if min_programs_per_sm > 0:
        want = min_programs_per_sm * sm_count
        while rows > MIN_TILE_ROWS and -(-grid_rows // rows) * max(groups, 1) < want:
            rows //= 2
    return rows


def _launch(
    caches: Sequence[torch.Tensor],
    groups_of_segments: Sequence[tuple[Sequence[int], Sequence[int], int]],
    block_ids: torch.Tensor,
    word: int,
    align: int,
    rows_per_segment: int,
    groups: int,
    interpret: bool,
    total_rows: int | None = None,
    **scalars: int,
) -> None:
    """One launch over one or two record sizes.

    Args:
        groups_of_segments: up to two ``(cache indices, flat offsets in bytes, record bytes)``.
        rows_per_segment: rows of one segment in one group (chunk_tokens; max rank rows for DCP).
        groups: chunks (MODE_CHUNK) or ranks (MODE_GATHER); 1 for MODE_SCATTER.
        total_rows: rows of one group when not ``segments x rows_per_segment`` (MODE_SCATTER).
    """
    module, triton = _kernel(interpret)
    a = dict(flat_off=0, group_stride=0, chunk_tokens=1, tokens=0, token_start=0, ranks=1, rank0=0, row_lo=0, row_hi=0)
    a.update(scalars)
    parts = []
    for index, flat_bytes, rec_bytes in groups_of_segments:
        rec = rec_bytes // word
        cols = 1 << (rec.bit_length() - 1)  # head: largest power of two <= rec
        tail = triton.next_power_of_2(rec - cols) if rec > cols else 0
        grid_rows = len(index) * rows_per_segment if total_rows is None else total_rows
        rows = tile_rows(rec, grid_rows, groups, 1 if interpret else _sm_count(caches[0].device),
                         0 if interpret else MIN_PROGRAMS_PER_SM)
        if grid_rows >= 2**31:
            raise ValueError("one launch is limited to 2**31 rows")
        table = _seg_table(caches, index, word, flat_bytes)
        parts.append((table, len(index), rec, cols, tail, rows, triton.cdiv(grid_rows, rows)))
    if len(parts) == 1:
        parts.append((parts[0][0], 0, 0, 1, 0, 1, 0))
    (t1, n1, rec1, cols1, tail1, rows1, tiles1), (t2, n2, rec2, cols2, tail2, rows2, tiles2) = parts
    if tiles1 + tiles2 == 0 or groups == 0:
        return
    if groups * a["chunk_tokens"] >= 2**31 or a["token_start"] + a["tokens"] >= 2**31:
        raise ValueError("one launch is limited to 2**31 token positions")
    anchor = triton.reinterpret(caches[0], _tl_word(word))
    bt_2d = block_ids.dim() == 2
    bt_cols = block_ids.shape[1] if bt_2d else 1
    bt_s0 = block_ids.stride(0) if bt_2d else 0
    bt_s1 = block_ids.stride(1) if bt_2d else block_ids.stride(0)
    with _interpret_env(True) if interpret else contextlib.nullcontext():
        if n2 == 0 and PERSIST_CTAS_PER_SM > 0:
            programs = min(tiles1 * groups, _sm_count(caches[0].device) * PERSIST_CTAS_PER_SM)
            module._copy_rows_persistent_kernel[(programs,)](
                anchor, t1, block_ids, max(bt_cols, 1), bt_s0, bt_s1, n1, tiles1, groups,
                a["flat_off"], a["group_stride"],
                a["tokens"], a["token_start"], a["ranks"], a["rank0"], a["row_lo"], a["row_hi"],
                MODE=a["mode"], TO_PAGED=a["to_paged"], PAGE=caches[0].shape[1], CHUNK=a["chunk_tokens"],
                BT_2D=bt_2d, REC=rec1, COLS=cols1, TAIL=tail1, ROWS=rows1, ALIGN=align, num_warps=NUM_WARPS,
            )
            return
        for g0 in range(0, groups, _MAX_GRID_Y):
            module._copy_rows_kernel[(tiles1 + tiles2, min(_MAX_GRID_Y, groups - g0))](
                anchor, t1, t2, t1, block_ids, max(bt_cols, 1), bt_s0, bt_s1, n1, n2, tiles1,
                a["flat_off"], a["group_stride"],
                a["tokens"], a["token_start"], a["ranks"], a["rank0"], a["row_lo"], a["row_hi"], g0,
                MODE=a["mode"], TO_PAGED=a["to_paged"], PAGE=caches[0].shape[1], CHUNK=a["chunk_tokens"],
                BT_2D=bt_2d, REC=rec1, COLS=cols1, TAIL=tail1, ROWS=rows1,
                REC2=rec2, COLS2=cols2, TAIL2=tail2, ROWS2=rows2,
                ALIGN=align, num_warps=NUM_WARPS,
            )


def _spec(arg: Any) -> tuple:
    """What Triton specializes a launch argument on (a superset: equal tuples, equal kernels)."""
    if isinstance(arg, bool):
        return ("b", arg)
    if isinstance(arg, int):
        return ("i", arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31, arg < 2**63)
    return ("p", str(arg.dtype), arg.data_ptr() % 16 == 0)


def _sm_count(device: torch.device) -> int:
    """Multiprocessors (CUDA) or compute units (ROCm) of ``device``; 4 on the CPU (interpreter)."""
    if device.type == "cpu":
        return 4
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _tl_word(word: int) -> Any:
    import triton.language as tl

    return {4: tl.int32, 2: tl.int16, 1: tl.uint8}[word]


def _chunk_op(
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    objects: torch.Tensor,
    num_chunks: int,
    chunk_tokens: int,
    to_paged: bool,
    interpret: bool,
) -> None:
    recs = [c.shape[2] * c.element_size() for c in caches]
    offsets, acc = [], 0
    for rb in recs:
        offsets.append(acc)
        acc += chunk_tokens * rb
    quantities = _cache_quantities(caches) + [objects.data_ptr(), objects.stride(0)]
    word, align = _word_bytes(quantities)
    flat_off = (objects.data_ptr() - caches[0].data_ptr()) // word
    by_rec: dict[int, list[int]] = {}
    for i, rb in enumerate(recs):
        by_rec.setdefault(rb, []).append(i)
    # REC is a compile-time constant (vectorized, unmasked-by-size copies): one launch per two sizes
    sizes = [(index, [offsets[i] for i in index], rb) for rb, index in by_rec.items()]
    step = 2 if PAIR_RECORD_SIZES else 1
    for k in range(0, len(sizes), step):
        _launch(
            caches, sizes[k : k + step], block_ids, word, align, chunk_tokens, groups=num_chunks, interpret=interpret,
            mode=MODE_CHUNK, to_paged=to_paged, flat_off=flat_off,
            group_stride=objects.stride(0) // word if num_chunks > 1 else 0, chunk_tokens=chunk_tokens,
        )


def pack_triton(
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    num_chunks: int | None = None,
    chunk_tokens: int = 256,
    out: torch.Tensor | None = None,
    fmt: ChunkFormat | None = None,
    validate: bool = True,
    interpret: bool | None = None,
) -> torch.Tensor:
    """Triton ``pack``: see ``kvpool.kernels.ops.pack`` for the contract."""
    geom, num_chunks, out = ck.prepare_chunks(caches, block_ids, num_chunks, chunk_tokens, out, fmt, validate, False)
    _chunk_op(caches, block_ids, out, num_chunks, chunk_tokens, False, _use_interpreter(geom.device, interpret))
    return out


def unpack_triton(
    objects: torch.Tensor,
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    num_chunks: int | None = None,
    chunk_tokens: int = 256,
    fmt: ChunkFormat | None = None,
    validate: bool = True,
    interpret: bool | None = None,
) -> None:
    """Triton ``unpack``: see ``kvpool.kernels.ops.unpack`` for the contract."""
    geom, num_chunks, _ = ck.prepare_chunks(caches, block_ids, num_chunks, chunk_tokens, objects, fmt, validate, True)
    _chunk_op(caches, block_ids, objects, num_chunks, chunk_tokens, True, _use_interpreter(geom.device, interpret))


def gather_dcp_triton(
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    plan: HandoffPlan,
    out: torch.Tensor | None = None,
    validate: bool = True,
    interpret: bool | None = None,
) -> torch.Tensor:
    """Triton ``gather_dcp``: see ``kvpool.kernels.ops.gather_dcp`` for the contract."""
    geom, out = ck.prepare_gather(caches, block_ids, plan, out, validate)
    use_interp = _use_interpreter(geom.device, interpret)
    word, align = _word_bytes(_cache_quantities(caches) + [out.data_ptr()])
    max_rows = max(plan.rank_tokens(r) for r in range(plan.ranks))
    _launch(
        caches, [(range(len(caches)), [0] * len(caches), plan.record_bytes)], block_ids, word, align,
        max_rows, groups=plan.ranks if plan.tokens else 0, interpret=use_interp,
        mode=MODE_GATHER, to_paged=False, flat_off=(out.data_ptr() - caches[0].data_ptr()) // word,
        tokens=plan.tokens, token_start=plan.token_start, ranks=plan.ranks,
    )
    return out


def scatter_dcp_triton(
    landing: torch.Tensor,
    caches: Sequence[torch.Tensor],
    block_ids: torch.Tensor,
    plan: HandoffPlan,
    rank: int,
    offset_bytes: int = 0,
    validate: bool = True,
    interpret: bool | None = None,
) -> None:
    """Triton ``scatter_dcp``: see ``kvpool.kernels.ops.scatter_dcp`` for the contract."""
    geom, row0, rows = ck.prepare_scatter(landing, caches, block_ids, plan, rank, offset_bytes, validate)
    use_interp = _use_interpreter(geom.device, interpret)
    word, align = _word_bytes(_cache_quantities(caches) + [landing.data_ptr()])
    rec_words = plan.record_bytes // word
    _launch(
        caches, [(range(len(caches)), [0] * len(caches), plan.record_bytes)], block_ids, word, align,
        0, groups=1 if rows else 0, interpret=use_interp, total_rows=rows,
        mode=MODE_SCATTER, to_paged=True,
        flat_off=(landing.data_ptr() - caches[0].data_ptr()) // word - row0 * rec_words,
        tokens=plan.tokens, token_start=plan.token_start, ranks=plan.ranks, rank0=rank,
        row_lo=row0, row_hi=row0 + rows,
    )




class DcpLauncher:
    """Launches of ``gather_dcp`` / multi-segment ``scatter_dcp`` over one fixed list of caches.

    The caller has checked the caches (``ops.GatherDcp`` / ``ops.ScatterDcp``); the cache
    quantities, word size and address table are computed here once, so a launch costs the Triton
    call and a few integer operations (the per-call cache checks and table keys of the plain ops
    cost hundreds of microseconds of host time for a 20-layer stage).
    """

    def __init__(self, caches: Sequence[torch.Tensor], interpret: bool) -> None:
        self.caches = list(caches)
        self.interpret = interpret
        self.device = caches[0].device
        g = 0
        for q in _cache_quantities(self.caches):
            g = math.gcd(g, int(q))
        self._gcd = g
        self._anchor_ptr = caches[0].data_ptr()
        self.page = caches[0].shape[1]
        self._tables: dict[int, torch.Tensor] = {}
        self._segs: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._compiled: dict[tuple, Any] = {}

    def _word(self, *quantities: int) -> tuple[int, int]:
        g = self._gcd
        for q in quantities:
            g = math.gcd(g, int(q))
        g = math.gcd(g, 16) if g else 16
        word = 4 if g % 4 == 0 else 2 if g % 2 == 0 else 1
        return word, g // word

    def _table(self, word: int) -> torch.Tensor:
        t = self._tables.get(word)
        if t is None:
            t = self._tables[word] = _seg_table(self.caches, range(len(self.caches)), word, [0] * len(self.caches))
        return t

    def _run(self, word: int, align: int, rec_bytes: int, grid_rows: int, groups: int, block_ids: torch.Tensor,
             sg: torch.Tensor | None, flat_off: int, mode: int, to_paged: bool, tokens: int, token_start: int,
             ranks: int, rank0: int, row_lo: int = 0, row_hi: int = 0) -> None:
        module, triton = _kernel(self.interpret)
        rec = rec_bytes // word
        cols = 1 << (rec.bit_length() - 1)
        tail = triton.next_power_of_2(rec - cols) if rec > cols else 0
        rows = tile_rows(rec, grid_rows, groups, 1 if self.interpret else _sm_count(self.device),
                         0 if self.interpret else MIN_PROGRAMS_PER_SM)
        if grid_rows >= 2**31 or token_start + tokens >= 2**31:
            raise ValueError("one launch is limited to 2**31 rows and token positions")
        table = self._table(word)
        anchor = triton.reinterpret(self.caches[0], _tl_word(word))
        bt_2d = block_ids.dim() == 2
        bt_cols = block_ids.shape[1] if bt_2d else 1
        bt_s0 = block_ids.stride(0) if bt_2d else 0
        bt_s1 = block_ids.stride(1) if bt_2d else block_ids.stride(0)
        args = (anchor, table, table, table if sg is None else sg, block_ids, max(bt_cols, 1), bt_s0, bt_s1,
                len(self.caches), 0, 0, flat_off, 0, tokens, token_start, ranks, rank0, row_lo, row_hi, 0)
        consts = (("MODE", mode), ("TO_PAGED", to_paged), ("PAGE", self.page), ("CHUNK", 1), ("BT_2D", bt_2d),
                  ("REC", rec), ("COLS", cols), ("TAIL", tail), ("ROWS", rows), ("REC2", 0), ("COLS2", 1),
                  ("TAIL2", 0), ("ROWS2", 1), ("ALIGN", align))
        grid = (triton.cdiv(grid_rows, rows), groups, 1)
        fast = FAST_LAUNCH and not self.interpret
        if fast:
            key = (consts, NUM_WARPS, tuple(_spec(a) for a in args))
            compiled = self._compiled.get(key)
            if compiled is not None:
                compiled[grid](*args, *(v for _, v in consts))
                return
        with _interpret_env(True) if self.interpret else contextlib.nullcontext():
            compiled = module._copy_rows_kernel[grid](*args, **dict(consts), num_warps=NUM_WARPS)
        if fast and compiled is not None:
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            if hasattr(compiled, "__getitem__") and hasattr(compiled, "run"):
                self._compiled[key] = compiled

    def gather(self, block_ids: torch.Tensor, plan: HandoffPlan, out: torch.Tensor) -> None:
        """``gather_dcp`` into ``out`` (checked by the caller)."""
        if not plan.tokens:
            return
        word, align = self._word(out.data_ptr())
        max_rows = max(plan.rank_tokens(r) for r in range(plan.ranks))
        self._run(word, align, plan.record_bytes, len(self.caches) * max_rows, plan.ranks, block_ids, None,
                  (out.data_ptr() - self._anchor_ptr) // word, MODE_GATHER, False, plan.tokens, plan.token_start,
                  plan.ranks, 0)

    def scatter(self, landing: torch.Tensor, block_ids: torch.Tensor, plan: HandoffPlan, rank: int,
                segments: Sequence[tuple[int, int, int]]) -> None:
        """Scatter ``(landing_offset_bytes, row0, rows)`` segments (checked by the caller) of
        ``rank``'s buffer, one launch for all of them."""
        if not segments:
            return
        base = landing.data_ptr()
        word, align = self._word(*(base + lo for lo, _, _ in segments))
        rec = plan.record_bytes // word
        rows = []
        for lo, row0, n in segments:
            rows += [row0, row0 + n, (base + lo - self._anchor_ptr) // word - row0 * rec]
        key = tuple(rows)
        sg = self._segs.get(key)
        if sg is None:
            sg = torch.tensor(rows, dtype=torch.int64)
            if self.device.type != "cpu":
                sg = sg.to(self.device, non_blocking=True)
            self._segs[key] = sg
            if len(self._segs) > 256:
                self._segs.popitem(last=False)
        else:
            self._segs.move_to_end(key)
        self._run(word, align, plan.record_bytes, max(n for _, _, n in segments), len(segments), block_ids, sg,
                  0, MODE_SCATTER_SEGS, True, plan.tokens, plan.token_start, plan.ranks, rank)
