"""Side-channel messages of the prefill -> decode handoff, and the handoff's errors.

Every message is a frozen dataclass sent as one JSON object over pyzmq (``encode``/``decode``);
``"t"`` names the class. Who sends what, in order:

    prefill stage -> decode rank   ``Attach``   once per connection: "I am stage s"
    decode rank  -> prefill stage  ``Landing``  reply: how to reach the landing pool, the slots
                                                (credits) granted to that stage, slot size, epoch
    decode rank  -> prefill stage  ``Want``     per request: pages are ready, send; carries the nonce
    prefill stage -> decode rank   ``Ready``    per write: slot ``slot`` holds bytes
                                                ``offset_bytes .. +nbytes`` of the rank buffer
    prefill stage -> decode rank   ``Readies``  several READYs of one request in one message
                                                (the writes that completed together); the
                                                stage's last one to a rank carries its DONE
                                                (``done_writes`` >= 0) instead of a ``Done``.
                                                With a ``fence`` (a transport's device-side
                                                completion token) it is sent at submit time and
                                                the writes have landed once the fence completes
    prefill stage -> decode rank   ``Done``     per request: the stage sent ``writes`` writes
    decode rank  -> prefill stage  ``Credit``   slots free again (after scatter, or quarantine end)
    prefill stage -> decode rank   ``Abort``    the stage's part failed; ``quarantined`` slots may
                                                hold (or still receive) bytes of a failed write
    decode rank  -> prefill stage  ``Fail``     the decode rank gave the request up

Requests are named by ``request_id`` (a string chosen by the caller) and ``nonce`` (chosen by the
decode rank in ``Want``); a message whose nonce is not the current one is stale and is dropped
(its slot is credited back).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any


class HandoffError(RuntimeError):
    """A handoff failed; ``request_id`` names the request (may be empty for setup errors)."""

    def __init__(self, message: str, request_id: str = "") -> None:
        super().__init__(message)
        self.request_id = request_id


class CreditTimeout(HandoffError):
    """No credit (free landing slot) came back within the bounded wait."""


class PeerLost(HandoffError):
    """The side channel to a peer disconnected, or the peer stopped answering."""


class TransferFailed(HandoffError):
    """A transport write returned an error; its slot is quarantined."""


@dataclass(frozen=True)
class Attach:
    stage: int
    stage_name: str


@dataclass(frozen=True)
class Landing:
    rank: int
    epoch: int
    descriptor: dict
    slot_bytes: int
    slots: tuple[int, ...]


@dataclass(frozen=True)
class Want:
    request_id: str
    nonce: int
    rank: int


@dataclass(frozen=True)
class Ready:
    request_id: str
    nonce: int
    stage: int
    slot: int
    offset_bytes: int
    nbytes: int


@dataclass(frozen=True)
class Readies:
    """Several ``Ready`` of one request: slot ``slots[i]`` holds bytes ``offsets[i] .. +sizes[i]``."""

    request_id: str
    nonce: int
    stage: int
    slots: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    done_writes: int = -1      # >= 0: also the stage's DONE for this rank (writes sent in all)
    fence: str = ""            # non-empty: landed once this transport fence completes (not yet now)


@dataclass(frozen=True)
class Done:
    request_id: str
    nonce: int
    stage: int
    writes: int
    nbytes: int


@dataclass(frozen=True)
class Credit:
    slots: tuple[int, ...]


@dataclass(frozen=True)
class Abort:
    request_id: str
    nonce: int
    stage: int
    reason: str
    quarantined: tuple[int, ...]


@dataclass(frozen=True)
class Fail:
    request_id: str
    nonce: int
    rank: int
    reason: str


_dumps = json.JSONEncoder(separators=(",", ":")).encode
MESSAGES = {cls.__name__: cls for cls in (Attach, Landing, Want, Ready, Readies, Done, Credit, Abort, Fail)}
_TUPLE_FIELDS = {name: [f.name for f in fields(cls) if "tuple" in str(f.type)] for name, cls in MESSAGES.items()}


def encode(msg: Any) -> bytes:
    """One message as UTF-8 JSON bytes."""
    name = type(msg).__name__
    if name not in MESSAGES:
        raise TypeError(f"not a handoff message: {msg!r}")
    # vars(), not asdict(): the fields are plain values (asdict's deep copy cost ~20 us a READIES)
    return _dumps({"t": name, **vars(msg)}).encode()


def decode(data: bytes) -> Any:
    """Inverse of ``encode``; ``ValueError`` for anything that is not a known message."""
    try:
        obj = json.loads(data)
        name = obj.pop("t")
        cls = MESSAGES[name]
        for f in _TUPLE_FIELDS[name]:
            obj[f] = tuple(obj[f])
        return cls(**obj)
    except (KeyError, TypeError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"bad handoff message {data[:80]!r}: {exc}") from exc
