"""Token-id prompts built from a trace's hash ids: equal hash-id prefixes give equal token prefixes.

The traces carry no text, only one hash id per recorded block of ``block_tokens`` tokens. A
replay against a real server needs real token ids whose prefix structure is the trace's, so that
the server's chunk keys (hashes of the token ids) repeat exactly where the trace's blocks repeat.

Contract:
    * ``PromptBuilder(vocab, token_scale=1.0).prompt(dispatch) -> list[int]`` is the prompt of a
      ``workload.replay.Dispatch``: ``workload.token_scale.scaled_prompt_tokens(in_tokens,
      block_tokens, F)`` token ids. Scaled position ``q`` lies in block ``k = q // b`` (``b =
      scaled_block_tokens(block_tokens, F)``); while ``k`` is one of the request's hash blocks the
      token is ``block_tokens(scope, hash_id)[q % b]``, past them (a recorded prompt longer than
      its blocks) it is a tail token private to this request of this play.
    * A block's tokens are a pure function of ``(scope, hash_id, b)``: BLAKE2b-512, keyed with
      ``KEY``, of ``"{scope}\\0{hash_id}\\0{counter}"`` for counters 0, 1, ... gives 16
      little-endian 32-bit words per digest; word ``w`` becomes ``w % (vocab - 1)``, plus one
      when that is ``>= EOS_TOKEN``. So every id lies in ``[0, vocab)`` and none is ``EOS_TOKEN``.
      ``scope`` is the dispatch's chunk-key scope (session and play for local ids, ``""`` for
      global ones), so plays of a trace never share tokens and Mooncake rows share theirs.
    * Tail tokens use the same words of ``"{session}\\0{scope}\\0tail\\0{request index}\\0{counter}"``.
    * No state besides a bounded cache of block tokens: the same dispatch gives the same prompt in
      any process, on any machine.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

import numpy as np

from kvpool.backend.serve.model_config import EOS_TOKEN
from kvpool.workload.replay import Dispatch
from kvpool.workload.token_scale import check_token_scale, scaled_block_tokens, scaled_prompt_tokens

#: Key of the keyed BLAKE2b that turns hash ids into token ids (a fixed, public constant).
KEY = b"kvpool replay prompts v1"
_WORDS_PER_DIGEST = 16  # 64-byte digest, 4 bytes per word
_CACHED_BLOCKS = 1 << 16


def _words(label: str, n: int) -> np.ndarray:
    """``n`` 32-bit words of the keyed BLAKE2b stream of ``label``."""
    digests = b"".join(hashlib.blake2b(f"{label}\0{c}".encode(), digest_size=64, key=KEY).digest()
                       for c in range(-(-n // _WORDS_PER_DIGEST)))
    return np.frombuffer(digests, dtype="<u4")[:n].astype(np.int64)


def _to_ids(words: np.ndarray, vocab: int) -> np.ndarray:
    ids = words % (vocab - 1)
    return ids + (ids >= EOS_TOKEN)


class PromptBuilder:
    """Prompts of dispatches for a model of ``vocab`` token ids, scaled by ``token_scale``."""

    def __init__(self, vocab: int, token_scale: float = 1.0):
        if vocab <= EOS_TOKEN:
            raise ValueError(f"vocab must be > {EOS_TOKEN} (the end-of-sequence id), got {vocab}")
        self.vocab = vocab
        self.token_scale = check_token_scale(token_scale)
        self._block = lru_cache(maxsize=_CACHED_BLOCKS)(self._block_uncached)

    def _block_uncached(self, scope: str, hash_id: int, n: int) -> np.ndarray:
        ids = _to_ids(_words(f"{scope}\0{hash_id}", n), self.vocab)
        ids.flags.writeable = False
        return ids

    def block_tokens(self, scope: str, hash_id: int, n: int) -> np.ndarray:
        """The ``n`` token ids of hash block ``hash_id`` under ``scope`` (read-only)."""
        return self._block(scope, int(hash_id), n)

    def prompt_tokens(self, d: Dispatch) -> int:
        """The length of ``d``'s prompt after scaling."""
        return scaled_prompt_tokens(d.in_tokens, d.session.block_tokens, self.token_scale)

    def prompt(self, d: Dispatch) -> list[int]:
        """``d``'s prompt as token ids (see the module contract)."""
        b = scaled_block_tokens(d.session.block_tokens, self.token_scale)
        n = self.prompt_tokens(d)
        hash_ids = d.block_ids()
        full = min(len(hash_ids), -(-n // b))
        parts = [self.block_tokens(d.scope, h, b) for h in hash_ids[:full].tolist()]
        covered = full * b
        if covered < n:
            label = f"{d.session.id}\0{d.scope}\0tail\0{d.request.index}"
            parts.append(_to_ids(_words(label, n - covered), self.vocab))
        return np.concatenate(parts)[:n].tolist() if parts else []
