"""The command channel between a prefill engine and its stage processes: ZMQ on 127.0.0.1, JSON + raw tensor bytes.

Wire format (one ZMQ multipart message each way):
    ``[header, tensor_0, tensor_1, ...]``: ``header`` is UTF-8 JSON ``{"id": int, "cmd": str, ...,
    "tensors": [{"dtype": str, "shape": [int, ...]}, ...]}``; every following frame holds one
    tensor's raw bytes (C order). Only the dtypes of ``DTYPES`` cross; a frame whose size does not
    match its declared shape is refused (``LinkError``). Nothing is ever unpickled.
    A reply repeats the request's ``id`` and ``cmd`` and carries ``"ok": true`` or
    ``"ok": false, "error": reason``.

Primitives:
    ``encode(header, tensors) -> frames``, ``decode(frames) -> (header, tensors)``
    ``load_plan_json`` / ``load_plan_from_json``, ``save_plan_*``, ``handoff_plan_*``, ``stage_report_*``,
    ``save_report_*``: the connector's and the hand-off's messages as JSON (strict: a missing or
    mistyped field is a ``LinkError``).
    ``Waker``: wake a thread blocked in a ZMQ poll from any other thread (inproc PUSH/PULL).
    ``StageClient``: the engine's DEALER sockets, one per stage; ``send`` returns a call id, ``poll``
    returns the replies that arrived; ``call`` waits (bounded) for one reply and keeps the others
    for the next ``poll``. One thread uses a ``StageClient``.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch
import zmq

from kvpool.backend.connector_data import LoadPlan, SavePlan, StageObjects, StageReport, StageSaveReport
from kvpool.policy.layout import HandoffPlan

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
MAX_DIMS = 4
GIVE_UP_EVERY_S = 0.1


class LinkError(ValueError):
    """A malformed message on the engine <-> stage channel."""


# -- frames ------------------------------------------------------------------------------------
def encode(header: dict, tensors: Sequence[torch.Tensor] = ()) -> list[bytes | memoryview]:
    """Header JSON plus one raw-bytes frame per tensor (moved to the CPU, made contiguous).

    A tensor's frame is a view of its CPU bytes, not a copy: sent with ``copy=False``, a tensor
    already on the CPU must not change until ZMQ has sent it (the engine relays received tensors;
    a stage sends a fresh copy off its device)."""
    metas, frames = [], []
    for t in tensors:
        if t.dtype not in _DTYPE_NAMES:
            raise LinkError(f"dtype {t.dtype} cannot cross the stage link")
        c = t.detach().to("cpu").contiguous()
        metas.append({"dtype": _DTYPE_NAMES[t.dtype], "shape": list(c.shape)})
        frames.append(memoryview(c.view(torch.uint8).reshape(-1).numpy()) if c.numel() else b"")
    return [json.dumps({**header, "tensors": metas}).encode(), *frames]


def decode(frames: Sequence[bytes | zmq.Frame]) -> tuple[dict, list[torch.Tensor]]:
    """Inverse of ``encode``; ``LinkError`` for anything malformed. A tensor decoded from a
    ``zmq.Frame`` (received with ``copy=False``) shares the frame's memory; one from ``bytes`` is a
    copy (``bytes`` are read-only)."""
    if not frames:
        raise LinkError("empty message")
    try:
        header = json.loads(bytes(frames[0]))
    except (ValueError, UnicodeDecodeError) as e:
        raise LinkError(f"header is not JSON: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("cmd"), str) or not _is_int(header.get("id")):
        raise LinkError("header: expected an object with an integer 'id' and a string 'cmd'")
    metas = header.get("tensors", [])
    if not isinstance(metas, list) or len(metas) != len(frames) - 1:
        raise LinkError(f"header declares {len(metas) if isinstance(metas, list) else '?'} tensors, "
                        f"message has {len(frames) - 1} frames")
    tensors = []
    for i, (meta, frame) in enumerate(zip(metas, frames[1:])):
        dtype = DTYPES.get(meta.get("dtype")) if isinstance(meta, dict) else None
        shape = meta.get("shape") if isinstance(meta, dict) else None
        if dtype is None or not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(
                _is_int(d) and d >= 0 for d in shape):
            raise LinkError(f"tensor {i}: expected dtype in {sorted(DTYPES)} and a shape of <= {MAX_DIMS} sizes")
        raw = frame.buffer if isinstance(frame, zmq.Frame) else bytearray(frame)
        n = 1
        for d in shape:
            n *= d
        if len(raw) != n * torch.empty((), dtype=dtype).element_size():
            raise LinkError(f"tensor {i}: {len(raw)} bytes do not match shape {shape} of {meta['dtype']}")
        flat = torch.frombuffer(raw, dtype=torch.uint8) if len(raw) else torch.empty(0, dtype=torch.uint8)
        tensors.append(flat.view(dtype).reshape(shape))
    return header, tensors


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _need(d: Any, name: str, kind: type | tuple[type, ...]) -> Any:
    v = d.get(name) if isinstance(d, dict) else None
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise LinkError(f"{name}: expected {getattr(kind, '__name__', kind)}, got {v!r}")
    return v


def int_list(d: Any, name: str) -> list[int]:
    v = _need(d, name, list)
    if not all(_is_int(x) for x in v):
        raise LinkError(f"{name}: expected a list of integers")
    return v


# -- the connector's and hand-off's messages as JSON --------------------------------------------
def _objects_json(stages: Sequence[StageObjects]) -> list[dict]:
    return [{"stage": s.stage, "keys": list(s.keys), "object_bytes": s.object_bytes} for s in stages]


def _objects_from_json(v: Any) -> tuple[StageObjects, ...]:
    if not isinstance(v, list):
        raise LinkError("stages: expected a list")
    out = []
    for s in v:
        keys = _need(s, "keys", list)
        if not all(isinstance(k, str) for k in keys):
            raise LinkError("stages[].keys: expected strings")
        out.append(StageObjects(_need(s, "stage", int), tuple(keys), _need(s, "object_bytes", int)))
    return tuple(out)


def load_plan_json(p: LoadPlan) -> dict:
    return {"request_id": p.request_id, "first_chunk": p.first_chunk, "end_chunk": p.end_chunk,
            "stages": _objects_json(p.stages), "pool_tokens": p.pool_tokens, "rechecked": p.rechecked}


def load_plan_from_json(d: Any) -> LoadPlan:
    return LoadPlan(_need(d, "request_id", str), _need(d, "first_chunk", int), _need(d, "end_chunk", int),
                    _objects_from_json(d.get("stages")), _need(d, "pool_tokens", int), _need(d, "rechecked", bool))


def save_plan_json(p: SavePlan) -> dict:
    return {"request_id": p.request_id, "first_chunk": p.first_chunk, "end_chunk": p.end_chunk,
            "group_ids": list(p.group_ids), "stages": _objects_json(p.stages)}


def save_plan_from_json(d: Any) -> SavePlan:
    groups = _need(d, "group_ids", list)
    if not all(isinstance(g, str) for g in groups):
        raise LinkError("group_ids: expected strings")
    return SavePlan(_need(d, "request_id", str), _need(d, "first_chunk", int), _need(d, "end_chunk", int),
                    tuple(groups), _objects_from_json(d.get("stages")))


def handoff_plan_json(p: HandoffPlan) -> dict:
    return asdict(p)


def handoff_plan_from_json(d: Any) -> HandoffPlan:
    try:
        return HandoffPlan(*(_need(d, k, int) for k in ("tokens", "layers", "record_bytes", "ranks",
                                                         "max_write_bytes", "token_start")))
    except ValueError as e:
        raise LinkError(f"handoff plan: {e}") from None


def _dataclass_from_json(cls: type, d: Any) -> Any:
    if not isinstance(d, dict):
        raise LinkError(f"{cls.__name__}: expected an object")
    try:
        return cls(**d)
    except TypeError as e:
        raise LinkError(f"{cls.__name__}: {e}") from None


def stage_report_from_json(d: Any) -> StageReport:
    return _dataclass_from_json(StageReport, d)


def save_report_from_json(d: Any) -> StageSaveReport:
    return _dataclass_from_json(StageSaveReport, d)


# -- threads and sockets -------------------------------------------------------------------------
class Waker:
    """Wake a thread blocked in ``zmq.Poller.poll`` (it registers ``socket``) from any thread."""

    def __init__(self, ctx: zmq.Context) -> None:
        addr = f"inproc://kvpool-waker-{uuid.uuid4().hex}"
        self.socket = ctx.socket(zmq.PULL)
        self.socket.bind(addr)
        self._push = ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.connect(addr)
        self._lock = threading.Lock()

    def wake(self) -> None:
        with self._lock:
            try:
                self._push.send(b"", zmq.NOBLOCK)
            except zmq.Again:
                pass  # already many wake-ups queued: the poller wakes anyway

    def drain(self) -> None:
        while True:
            try:
                self.socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def close(self) -> None:
        self._push.close(0)
        self.socket.close(0)


class StageClient:
    """The engine's side of the channel: one DEALER per stage (see the module docstring)."""

    def __init__(self, ctx: zmq.Context, endpoints: Sequence[str]) -> None:
        self.sockets = []
        for ep in endpoints:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            self.sockets.append(s)
        self._ids = itertools.count(1)
        self._kept: list[tuple[int, dict, list[torch.Tensor]]] = []

    def send(self, stage: int, cmd: str, body: dict | None = None, tensors: Sequence[torch.Tensor] = ()) -> int:
        cid = next(self._ids)
        self.sockets[stage].send_multipart(encode({"id": cid, "cmd": cmd, **(body or {})}, tensors), copy=False)
        return cid

    def register(self, poller: zmq.Poller) -> None:
        for s in self.sockets:
            poller.register(s, zmq.POLLIN)

    @property
    def has_kept(self) -> bool:
        """Replies already read (by ``call``) and not yet returned by ``poll``: poll again without waiting."""
        return bool(self._kept)

    def poll(self) -> list[tuple[int, dict, list[torch.Tensor]]]:
        """``(stage, header, tensors)`` of every reply that has arrived (without waiting)."""
        out, self._kept = self._kept, []
        for stage, s in enumerate(self.sockets):
            while True:
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                try:
                    header, tensors = decode(frames)
                except LinkError:
                    continue  # a stage never sends one; nothing can be matched to it
                out.append((stage, header, tensors))
        return out

    def call(self, stage: int, cmd: str, body: dict | None, timeout_s: float) -> dict | None:
        """Send and wait up to ``timeout_s`` for the reply's header; ``None`` on timeout."""
        return self.call_all([stage], cmd, [body], timeout_s)[0]

    def call_all(self, stages: Sequence[int], cmd: str, bodies: Sequence[dict | None], timeout_s: float,
                 give_up: Callable[[], bool] = lambda: False) -> list[dict | None]:
        """One command to several stages at once; each reply header, or ``None`` if it did not come in
        time (``timeout_s``, or as soon as ``give_up()``, asked every ``GIVE_UP_EVERY_S``, is true)."""
        want = {self.send(s, cmd, b): i for i, (s, b) in enumerate(zip(stages, bodies))}
        got: list[dict | None] = [None] * len(want)
        poller = zmq.Poller()
        for s in set(stages):
            poller.register(self.sockets[s], zmq.POLLIN)
        deadline = time.monotonic() + timeout_s
        kept = []
        while want:
            for item in self.poll():
                i = want.pop(item[1]["id"], None)
                if i is None:
                    kept.append(item)
                else:
                    got[i] = item[1]
            left = deadline - time.monotonic()
            if not want or left <= 0 or give_up():
                break
            poller.poll(max(1, int(min(left, GIVE_UP_EVERY_S) * 1000)))
        self._kept = kept + self._kept
        return got

    def close(self) -> None:
        for s in self.sockets:
            s.close(0)
