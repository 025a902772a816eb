"""Chunk keys and group ids: how a prompt's history is named in the pool.

Contract:
    * A prompt is cut into chunks of ``chunk_tokens`` tokens (default 256, a multiple of the GPU
      page size). Only full chunks are keyed; a partial last chunk is never keyed, stored or loaded.
    * Keys are a prefix-hash chain: ``d_i = BLAKE2b-128(d_{i-1} || payload_i)`` with the
      personalization ``kvpool-chain-v1``. Equal digests therefore mean equal prefixes.
    * ``d_{-1}`` (the seed) is derived from the deployment's namespace and an optional scope, so
      different models, layouts or pool formats never read each other's bytes, and traces whose
      block ids are local to one session never alias each other.
    * Two kinds of input give digests by the same chain:
        - token ids (the backend): ``payload = b"T" + tokens as little-endian int32``;
        - per-block hash ids from traces (64-token Weka blocks, 512-token Mooncake blocks):
          ``payload = b"B" + block_tokens as u32 + for each block piece in the chunk
          (block id as u64, first token offset in the block as u32, token count as u32)``.
          A chunk is keyed only if every block it touches is a full block of the prompt.
    * One pool object per (chunk, pipeline stage): ``{namespace}/s{stage}of{stages}/{digest_hex}``;
      one group id per chunk, shared by its stage objects: ``{namespace}/group/{digest_hex}``.

Never uses the built-in ``hash()``: digests are stable across processes, machines and runs.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np

from kvpool.policy.kvspec import KVSpec

ChunkDigest = NewType("ChunkDigest", bytes)

DIGEST_BYTES = 16
CHAIN_PERSON = b"kvpool-chain-v1"
SEED_PERSON = b"kvpool-seed-v1"
NAMESPACE_PREFIX = "kvpool1-"
#: Version of the pool object byte format (layer-major records of one stage; see docs/pool-format.md).
POOL_FORMAT_VERSION = 1
_U32_MAX = 2**32 - 1
_U64_MAX = 2**64 - 1


def namespace_for(spec: KVSpec, chunk_tokens: int, extra: dict | None = None) -> str:
    """Key namespace of a deployment: ``kvpool1-`` + BLAKE2b-96 of a canonical JSON document.

    The document holds the KV geometry (model, layers, records, stage split, page size), the chunk
    size and the pool object format version, plus ``extra`` (e.g. dtype names) when given.
    """
    doc = {"kv": spec.identity(), "chunk_tokens": chunk_tokens, "format": POOL_FORMAT_VERSION}
    if extra:
        doc["extra"] = extra
    canon = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    return NAMESPACE_PREFIX + hashlib.blake2b(canon, digest_size=12).hexdigest()


def chain_seed(namespace: str, scope: str = "") -> ChunkDigest:
    """The chain's starting digest for ``namespace`` and ``scope`` (e.g. a trace id for local ids)."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=SEED_PERSON)
    h.update(namespace.encode())
    h.update(b"\x00")
    h.update(scope.encode())
    return ChunkDigest(h.digest())


# The chain's keyed hasher, set up once: copying it is about twice as fast as building one.
_CHAIN_HASHER = hashlib.blake2b(digest_size=DIGEST_BYTES, person=CHAIN_PERSON)


def _link(parent: bytes, payload: bytes) -> ChunkDigest:
    h = _CHAIN_HASHER.copy()
    h.update(parent)
    h.update(payload)
    return ChunkDigest(h.digest())


def full_chunks(n_tokens: int, chunk_tokens: int) -> int:
    """Number of full chunks in a prompt of ``n_tokens`` tokens."""
    return max(0, n_tokens) // chunk_tokens


def _check_chunk_tokens(chunk_tokens: int, page_tokens: int | None = None) -> None:
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
    if page_tokens is not None and chunk_tokens % page_tokens:
        raise ValueError(f"chunk_tokens {chunk_tokens} must be a multiple of the page size {page_tokens}")


def digests_from_tokens(
    token_ids: Sequence[int] | np.ndarray, chunk_tokens: int, seed: bytes
) -> list[ChunkDigest]:
    """Chained digests of the full chunks of a token-id prompt (the backend's input)."""
    _check_chunk_tokens(chunk_tokens)
    tokens = np.asarray(token_ids, dtype=np.int64)
    if tokens.size and (tokens.min() < -(2**31) or tokens.max() >= 2**31):
        raise ValueError("token ids must fit in int32")
    raw = tokens.astype("<i4").tobytes()
    step = chunk_tokens * 4
    out: list[ChunkDigest] = []
    parent = seed
    for i in range(full_chunks(len(tokens), chunk_tokens)):
        parent = _link(parent, b"T" + raw[i * step : (i + 1) * step])
        out.append(parent)
    return out


def digests_from_blocks(
    block_ids: Sequence[int],
    block_tokens: int,
    n_tokens: int,
    chunk_tokens: int,
    seed: bytes,
    start_chunk: int = 0,
) -> list[ChunkDigest]:
    """Chained digests of the full chunks of a prompt described by per-block hash ids (traces).

    Args:
        block_ids: one id per ``block_tokens``-token block of the prompt, in order; the last block
            may be partial (``n_tokens`` is not a multiple of ``block_tokens``).
        block_tokens: tokens per block (64 for Weka/AgentX traces, 512 for Mooncake traces).
        n_tokens: prompt length in tokens.
        chunk_tokens: tokens per chunk.
        seed: the chain seed (``chain_seed``); with ``start_chunk > 0``, the digest of chunk
            ``start_chunk - 1`` (continue a chain already computed for a shared prefix).
        start_chunk: first chunk to compute; the result holds chunks ``start_chunk ..``.

    A chunk is keyed only if it lies within ``n_tokens`` and every block it touches is full.
    """
    raw, bounds = block_pieces(block_ids, block_tokens, n_tokens, chunk_tokens, start_chunk)
    if not raw:
        return []
    head = block_head(block_tokens)
    out: list[ChunkDigest] = []
    parent = seed
    hasher = _CHAIN_HASHER  # _link, inlined: this loop runs once per chunk of every prompt
    for a, b in bounds:
        h = hasher.copy()
        h.update(parent)
        h.update(head)
        h.update(raw[a:b])
        parent = h.digest()
        out.append(parent)
    return out


_PIECE = np.dtype([("id", "<u8"), ("off", "<u4"), ("take", "<u4")])  # one block piece, 16 bytes


def block_head(block_tokens: int) -> bytes:
    """What every link of a block-id chain hashes between the parent digest and the chunk's
    pieces: ``b"B"`` and the block size as u32."""
    return b"B" + struct.pack("<I", block_tokens)


def block_pieces(block_ids: Sequence[int], block_tokens: int, n_tokens: int, chunk_tokens: int,
                 start_chunk: int = 0) -> tuple[bytes, Iterable[tuple[int, int]]]:
    """The chain payloads of chunks ``start_chunk ..`` of a prompt given by block ids (the
    arguments of ``digests_from_blocks``, validated the same way): every chunk's block pieces as
    packed records in one string, and each chunk's byte range ``(a, b)`` in it. Chunk ``i``'s
    digest is ``BLAKE2b(d_{i-1} || block_head(block_tokens) || raw[a:b])``, so two chunks have
    equal digests exactly when their parents' digests and these payloads are equal (and the
    head, fixed by ``block_tokens``). ``b""`` and no ranges when no chunk from ``start_chunk``
    is keyable. When chunks and blocks align every range has the same length, 16 bytes per block
    piece (``chunk_tokens // block_tokens`` pieces, or 1 when a block holds whole chunks)."""
    _check_chunk_tokens(chunk_tokens)
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be > 0, got {block_tokens}")
    n_blocks = len(block_ids)
    if n_tokens > n_blocks * block_tokens:
        raise ValueError(
            f"{n_tokens} tokens need {-(-n_tokens // block_tokens)} blocks of {block_tokens}, got {n_blocks}"
        )
    full_block_tokens = min(n_tokens, n_blocks * block_tokens) // block_tokens * block_tokens
    keyable = min(full_chunks(n_tokens, chunk_tokens), full_block_tokens // chunk_tokens)
    first = max(0, start_chunk)
    if first >= keyable:
        return b"", ()
    return _block_pieces(block_ids, block_tokens, chunk_tokens, first, keyable)


def _block_pieces(block_ids: Sequence[int], block_tokens: int, chunk_tokens: int, first: int,
                  keyable: int) -> tuple[bytes, Iterable[tuple[int, int]]]:
    """The block pieces of chunks ``first .. keyable-1`` as packed ``_PIECE`` records, and each
    chunk's byte range ``(a, b)`` in them.

    When chunks and blocks align (a chunk is whole blocks, or a block is whole chunks) every chunk
    has the same number of pieces and a piece's offset and length follow from its position, so the
    records are filled as pairs of u64 (id; offset | length << 32) in a few array operations."""
    lo, hi = first * chunk_tokens, keyable * chunk_tokens
    if chunk_tokens % block_tokens == 0:  # whole blocks per chunk (Weka: 4 x 64)
        per = chunk_tokens // block_tokens
        rec = np.empty((hi - lo) // block_tokens * 2, dtype="<u8")
        rec[0::2] = _as_u64(block_ids, first * per, keyable * per)
        rec[1::2] = block_tokens << 32  # offset 0, the whole block
    elif block_tokens % chunk_tokens == 0:  # chunks inside one block (Mooncake: 512 / 256)
        per = 1
        cuts = np.arange(lo, hi, chunk_tokens, dtype=np.int64)
        blocks = cuts // block_tokens
        rec = np.empty(cuts.size * 2, dtype="<u8")
        rec[0::2] = _as_u64(block_ids, int(blocks[0]), int(blocks[-1]) + 1)[blocks - blocks[0]]
        rec[1::2] = (cuts - blocks * block_tokens) | (chunk_tokens << 32)
    else:  # piece boundaries: every chunk and block boundary in [lo, hi)
        cuts = np.union1d(np.arange(lo, hi, chunk_tokens, dtype=np.int64),
                          np.arange(-(-lo // block_tokens) * block_tokens, hi, block_tokens, dtype=np.int64))
        ends = np.append(cuts[1:], hi)
        blocks = cuts // block_tokens
        pieces = np.empty(cuts.size, dtype=_PIECE)
        pieces["id"] = _as_u64(block_ids, int(blocks[0]), int(blocks[-1]) + 1)[blocks - blocks[0]]
        pieces["off"] = cuts - blocks * block_tokens
        pieces["take"] = ends - cuts
        bounds = np.searchsorted(cuts, np.arange(lo, hi + 1, chunk_tokens, dtype=np.int64)) * _PIECE.itemsize
        return pieces.tobytes(), zip(bounds[:-1].tolist(), bounds[1:].tolist())
    step = per * _PIECE.itemsize
    raw = rec.tobytes()
    return raw, ((a, a + step) for a in range(0, len(raw), step))


def _as_u64(block_ids: Sequence[int] | np.ndarray, start: int, stop: int) -> np.ndarray:
    """``block_ids[start:stop]`` as uint64, with a clear error for ids that are not u64."""
    part = block_ids[start:stop]
    arr = np.asarray(part)
    if arr.dtype.kind == "u":
        return arr.astype(np.uint64, copy=False)
    if arr.dtype.kind == "i":
        if arr.size and int(arr.min()) < 0:
            bad = int(np.flatnonzero(arr < 0)[0])
            raise ValueError(f"block id {int(arr[bad])} at block {start + bad} is not a u64")
        return arr.astype(np.uint64)
    try:
        return np.array([int(x) for x in part], dtype=np.uint64)
    except (OverflowError, ValueError, TypeError):
        for i, x in enumerate(part):
            if not isinstance(x, (int, np.integer)) or not 0 <= int(x) <= _U64_MAX:
                raise ValueError(f"block id {x!r} at block {start + i} is not a u64") from None
        raise


@dataclass(frozen=True)
class ChunkNaming:
    """Object keys and group ids of one deployment (namespace + stage count)."""

    namespace: str
    stages: int

    def object_key(self, digest: bytes, stage: int) -> str:
        """Pool key of ``stage``'s object for the chunk ``digest``."""
        if not 0 <= stage < self.stages:
            raise ValueError(f"stage {stage} out of range 0..{self.stages - 1}")
        return f"{self.namespace}/s{stage}of{self.stages}/{digest.hex()}"

    def group_id(self, digest: bytes) -> str:
        """Group id shared by every stage object of the chunk ``digest`` (evicted together)."""
        return f"{self.namespace}/group/{digest.hex()}"

    def stage_keys(self, digests: Sequence[bytes]) -> list[list[str]]:
        """``keys[stage][chunk]`` for every stage x chunk (one batched existence check)."""
        return [[self.object_key(d, s) for d in digests] for s in range(self.stages)]
