"""Text <-> token ids of the reference model: UTF-8 bytes are ids 0-255, larger ids are not text.

Contract:
    * ``encode(text) -> list[int]``: the UTF-8 bytes of ``text``.
    * ``decode(ids) -> str``: the bytes among ``ids`` (ids < 256) decoded as UTF-8 with
      ``errors="replace"``; other ids (``EOS_TOKEN`` = 256 and above) are left out of the text.
    * ``TextStream``: the same, fed a few ids at a time (a stream of chunks). A multi-byte character
      split across chunks appears once it is complete, so the concatenated chunks equal
      ``decode`` of all the ids.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

#: Ids below this are bytes of UTF-8 text.
BYTE_IDS = 256
#: The id that ends a generation unless ``ignore_eos`` (defined here, where the router's process can
#: import it without torch; ``model_config`` exports the same object).
EOS_TOKEN = 256


def encode(text: str) -> list[int]:
    """Token ids of ``text``: its UTF-8 bytes."""
    return list(text.encode("utf-8"))


def _bytes(ids: Iterable[int]) -> bytes:
    return bytes(t for t in ids if 0 <= t < BYTE_IDS)


def decode(ids: Iterable[int]) -> str:
    """Text of ``ids``: bytes decoded with ``errors="replace"``, ids >= 256 left out."""
    return _bytes(ids).decode("utf-8", errors="replace")


class TextStream:
    """Incremental ``decode``: ``feed`` returns the text completed by these ids, ``flush`` the rest."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, ids: Iterable[int]) -> str:
        return self._decoder.decode(_bytes(ids))

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)
