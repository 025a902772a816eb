"""The messages between the router and the engines of production mode, as JSON over HTTP on 127.0.0.1.

Every message is a frozen dataclass with ``to_json() -> dict`` and ``from_json(dict)``;
``from_json`` checks every field's type and range and raises ``ProtocolError`` (an HTTP 400 with
``{"error": reason}``) naming the field, so an engine never acts on a malformed message.

Router -> decode engine:
    ``ExpectRequest``    POST /expect: allocate pages for ``prompt_tokens + max_tokens`` tokens
                         and ask every rank's part from the stages of ``prefill_instance`` (the
                         prefill instance the router chose), whose landing slots alone it takes.
    ``GenerateRequest``  POST /generate: the descriptor and the first token; the answer is a
                         stream of NDJSON lines, each a ``TokenEvent`` (``done`` on the last).
    ``AbortRequest``     POST /abort: forget the request (its pages freed, its hand-off dropped).
Router -> prefill engine:
    ``PrefillRequest``   POST /prefill: compute the prompt and hand its KV to ``decode_instance``;
                         the answer is a ``PrefillResult``.
Every engine:
    GET /health -> ``Health``; GET /metrics -> Prometheus text.
Errors: any non-2xx answer carries ``{"error": reason}``; a stream ends with a ``TokenEvent``
whose ``error`` is set.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

#: Largest prompt or output the protocol carries, tokens (the gate's own caps are lower).
MAX_TOKENS = 1 << 24
#: Largest instance index a message carries (an engine checks it against its deployment).
MAX_INSTANCE = 1 << 16


class ProtocolError(ValueError):
    """A message that does not match its schema; the reason names the field."""


def _int(body: dict, name: str, lo: int, hi: int) -> int:
    v = body.get(name)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ProtocolError(f"{name}: expected an integer in [{lo}, {hi}], got {v!r}")
    return v


def _str(body: dict, name: str, max_len: int = 256) -> str:
    v = body.get(name)
    if not isinstance(v, str) or not 0 < len(v) <= max_len:
        raise ProtocolError(f"{name}: expected a non-empty string of at most {max_len} characters, got {v!r}")
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if not isinstance(v, bool):
        raise ProtocolError(f"{name}: expected true or false, got {v!r}")
    return v


def _token_ids(body: dict, name: str, vocab: int | None = None) -> tuple[int, ...]:
    v = body.get(name)
    if not isinstance(v, list) or not 0 < len(v) <= MAX_TOKENS:
        raise ProtocolError(f"{name}: expected a non-empty list of token ids (at most {MAX_TOKENS})")
    hi = (vocab if vocab is not None else 1 << 31) - 1
    for i, t in enumerate(v):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= hi:
            raise ProtocolError(f"{name}[{i}]: expected an integer token id in [0, {hi}], got {t!r}")
    return tuple(v)


def _only(body: Any, cls: type) -> dict:
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.__name__}: expected a JSON object")
    unknown = set(body) - {f.name for f in fields(cls)}
    if unknown:
        raise ProtocolError(f"{cls.__name__}: unknown field(s) {', '.join(sorted(unknown))}")
    return body


class _Message:
    def to_json(self) -> dict:
        return asdict(self)  # type: ignore[call-overload]


@dataclass(frozen=True)
class ExpectRequest(_Message):
    """``prefill_instance``: the prefill instance that computes the request and hands its KV over."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    prefill_instance: int

    @classmethod
    def from_json(cls, body: Any) -> ExpectRequest:
        b = _only(body, cls)
        return cls(_str(b, "request_id"), _int(b, "prompt_tokens", 1, MAX_TOKENS), _int(b, "max_tokens", 1, MAX_TOKENS),
                   _int(b, "prefill_instance", 0, MAX_INSTANCE))


@dataclass(frozen=True)
class PrefillRequest(_Message):
    """``token_ids`` of the whole prompt; the engine hands its KV to ``decode_instance``."""

    request_id: str
    token_ids: tuple[int, ...]
    decode_instance: int
    session: str = ""

    @classmethod
    def from_json(cls, body: Any, vocab: int | None = None) -> PrefillRequest:
        b = _only(body, cls)
        session = b.get("session", "")
        if not isinstance(session, str) or len(session) > 256:
            raise ProtocolError("session: expected a string of at most 256 characters")
        return cls(_str(b, "request_id"), _token_ids(b, "token_ids", vocab), _int(b, "decode_instance", 0, MAX_INSTANCE),
                   session)

    def to_json(self) -> dict:
        d = asdict(self)
        d["token_ids"] = list(self.token_ids)
        return d


@dataclass(frozen=True)
class PrefillResult(_Message):
    """What prefill did: the first token, where the prompt's tokens came from, what moved.

    ``record`` holds the ``kvpool.workload.records.RequestRecord`` fields prefill knows (token
    sources, restore per stage and spread, restore/save/hand-off bytes, hand-off writes and seconds,
    prefill start/end relative to the request's arrival at the engine); the router completes the
    identity and timing fields. ``descriptor`` tells decode where the KV is: ``{"decode_instance":
    d, "stages": pp}`` (pushed into that instance's landing slots under ``request_id``).
    """

    request_id: str
    first_token: int
    record: dict = field(default_factory=dict)
    descriptor: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, body: Any) -> PrefillResult:
        b = _only(body, cls)
        record, descriptor = b.get("record", {}), b.get("descriptor", {})
        if not isinstance(record, dict) or not isinstance(descriptor, dict):
            raise ProtocolError("record and descriptor: expected JSON objects")
        return cls(_str(b, "request_id"), _int(b, "first_token", 0, 1 << 31), record, descriptor)


@dataclass(frozen=True)
class GenerateRequest(_Message):
    """Generate ``max_tokens`` tokens after ``first_token`` (which counts as the first of them).

    ``ignore_eos``: keep generating past ``eos_token`` (AgentX pins output lengths this way).
    """

    request_id: str
    first_token: int
    max_tokens: int
    descriptor: dict
    ignore_eos: bool = True

    @classmethod
    def from_json(cls, body: Any) -> GenerateRequest:
        b = _only(body, cls)
        descriptor = b.get("descriptor")
        if not isinstance(descriptor, dict):
            raise ProtocolError("descriptor: expected the JSON object prefill answered")
        return cls(_str(b, "request_id"), _int(b, "first_token", 0, 1 << 31), _int(b, "max_tokens", 1, MAX_TOKENS),
                   descriptor, _bool(b, "ignore_eos", True))


@dataclass(frozen=True)
class AbortRequest(_Message):
    request_id: str

    @classmethod
    def from_json(cls, body: Any) -> AbortRequest:
        return cls(_str(_only(body, cls), "request_id"))


@dataclass(frozen=True)
class TokenEvent(_Message):
    """One NDJSON line of a /generate stream: ``tokens`` generated since the previous line.

    The last line has ``done`` true and ``finish_reason`` (``length`` or ``stop``), or ``error``.
    ``record`` on the last line: the decode side's ``RequestRecord`` fields (decode instance,
    hand-off seconds as decode saw them).
    """

    tokens: tuple[int, ...] = ()
    done: bool = False
    finish_reason: str = ""
    error: str = ""
    record: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d["tokens"] = list(self.tokens)
        return d

    @classmethod
    def from_json(cls, body: Any) -> TokenEvent:
        b = _only(body, cls)
        tokens = b.get("tokens", [])
        if not isinstance(tokens, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
            raise ProtocolError("tokens: expected a list of integers")
        return cls(tuple(tokens), _bool(b, "done", False), str(b.get("finish_reason", "")), str(b.get("error", "")),
                   b.get("record", {}) if isinstance(b.get("record", {}), dict) else {})


@dataclass(frozen=True)
class Health(_Message):
    """``GET /health`` of an engine: ``status`` is ``ok`` once it serves, ``starting`` before."""

    status: str
    role: str
    instance: int
    detail: dict = field(default_factory=dict)
