"""Transports of the handoff behind one interface: Mooncake Transfer Engine, same-host IPC, local.

Primitives, grouped by caller:
    Decode rank (owns the landing pool):
        ``allocate(nbytes, device) -> tensor``   landing memory this transport can expose
        ``expose(tensor) -> descriptor``         register it; a JSON-able dict for the side channel
    Prefill stage (writes into a peer's landing pool):
        ``register_source(tensor)``              staging memory (RDMA needs it registered)
        ``open(descriptor) -> Peer``             reach a peer's landing pool
        ``submit(peer, src, src_offset_bytes, dst_offset_bytes, nbytes) -> handle``
        ``submit_many(peer, src, src_offsets, dst_offsets, sizes) -> handle``  (one batch)
        ``submit_writes(peer, src, writes, after=None) -> [handle, ...]``  several writes
            ``(src_offset, dst_offset, nbytes)``, one handle each; ``after`` is a GPU event the
            source bytes are ready at (the gather that filled them). A transport may merge writes
            that are adjacent on both sides into one copy and complete them together.
        ``submit_group([(peer, writes), ...], src, after=None) -> [[handle, ...], ...]``  the
            writes of one request to several peers in one call (``submit_writes`` per peer, or
            one stream switch and one completion for all of them: ``IpcTransport``)
        ``poll(handle) -> 1 done | 0 running | -1 failed``  (never polls a finished handle twice)
    Optional, device-side completion (``IpcTransport`` on GPUs; ``None``/absent elsewhere):
        ``fence(handle) -> str | None``   a token another process can open to learn, without this
            process, when the write has landed (a CUDA/HIP interprocess event). The stage sends it
            in READIES at submit time, so the completion does not wait for the stage's own poll.
    Decode rank, for a fence token: ``open_fence(token, device) -> event`` (``query()`` is True
        once the write and every earlier write of the same writer have landed).
    Both: ``close()``.

Offsets are bytes from the start of the exposed / registered tensor; sources are 1-D contiguous
uint8 tensors. A write that reported -1 may still have landed, in part, and may still land later
(Mooncake's TCP work can outlive the Python-level deadline): the caller quarantines its slot.

Implementations:
    ``MooncakeTransport``  ``mooncake.engine.TransferEngine`` with ``P2PHANDSHAKE`` (segment name =
        host + ":" + ``get_rpc_port()``), TCP here and RDMA where the engine finds NICs;
        ``MC_FORCE_TCP`` is read by the engine itself (``force_tcp=True`` sets it before init).
        Host memory always; GPU memory only with a CUDA/ROCm build of the engine. The engine
        listens on every interface: outside a private network namespace the constructor refuses
        (``PublicListenersRefused``) unless ``allow_public_listeners=True`` or the namespace holds
        only ``lo`` and the interfaces ``KVPOOL_LISTEN_INTERFACES`` names.
    ``IpcTransport``       same host, other process: GPU tensors through CUDA/HIP IPC handles (torch's
        ``reduce_tensor``), CPU tensors through named POSIX shared memory. Copies are ``copy_`` on a
        side stream (GPU, completion by event) or synchronous (CPU).
    ``LocalTransport``     same process (tests, one-process setups): plain ``copy_``.
"""

from __future__ import annotations

import base64
import contextlib
import os
import pickle
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from kvpool.backend.pool.netns import check_listeners

DONE, RUNNING, FAILED = 1, 0, -1
_STORAGE_DEVICE = 6  # index of storage_device in torch's rebuild_cuda_tensor arguments (reduce_tensor)


@dataclass(frozen=True)
class Peer:
    """A peer's exposed landing pool as seen by a writer."""

    key: str
    nbytes: int
    descriptor: dict
    target: Any = field(default=None, compare=False, repr=False)


@dataclass
class WriteHandle:
    """One submitted write or batch; ``state`` caches a final DONE/FAILED."""

    token: Any
    state: int = RUNNING


class Transport(Protocol):
    name: str

    def allocate(self, nbytes: int, device: torch.device | str) -> torch.Tensor: ...
    def expose(self, buffer: torch.Tensor) -> dict: ...
    def register_source(self, buffer: torch.Tensor) -> None: ...
    def open(self, descriptor: dict) -> Peer: ...
    def submit(self, peer: Peer, src: torch.Tensor, src_offset_bytes: int, dst_offset_bytes: int,
               nbytes: int) -> WriteHandle: ...
    def submit_many(self, peer: Peer, src: torch.Tensor, src_offsets: list[int], dst_offsets: list[int],
                    sizes: list[int]) -> WriteHandle: ...
    def submit_writes(self, peer: Peer, src: torch.Tensor, writes: list[tuple[int, int, int]],
                      after: Any = None) -> list[WriteHandle]: ...
    def submit_group(self, jobs: list[tuple[Peer, list[tuple[int, int, int]]]], src: torch.Tensor,
                     after: Any = None) -> list[list[WriteHandle]]: ...
    def poll(self, handle: WriteHandle) -> int: ...
    def close(self) -> None: ...


def coalesce(writes: list[tuple[int, int, int]]) -> list[tuple[int, int, int]]:
    """Merge consecutive ``(src_offset, dst_offset, nbytes)`` writes that are adjacent on both sides."""
    runs: list[list[int]] = []
    for s, d, n in writes:
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1][2] += n
        else:
            runs.append([s, d, n])
    return [(s, d, n) for s, d, n in runs]


def _wait_host(after: Any) -> None:
    """Host-wait for a GPU event (transports whose writes read memory outside any stream)."""
    if after is not None:
        after.synchronize()


def _check_flat(t: torch.Tensor, what: str) -> None:
    if t.dim() != 1 or t.dtype != torch.uint8 or not t.is_contiguous():
        raise ValueError(f"{what} must be a 1-D contiguous uint8 tensor, got {t.dtype} {tuple(t.shape)}")


def _check_range(peer: Peer, dst_offset_bytes: int, nbytes: int) -> None:
    if dst_offset_bytes < 0 or nbytes <= 0 or dst_offset_bytes + nbytes > peer.nbytes:
        raise ValueError(f"write [{dst_offset_bytes}, +{nbytes}) outside the peer's {peer.nbytes} B pool")


class LocalTransport:
    """Same-process copies (one registry per process); handles complete at submit."""

    name = "local"
    _registry: dict[str, torch.Tensor] = {}

    def __init__(self) -> None:
        self._mine: list[str] = []

    def allocate(self, nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def expose(self, buffer: torch.Tensor) -> dict:
        _check_flat(buffer, "landing buffer")
        key = uuid.uuid4().hex
        LocalTransport._registry[key] = buffer
        self._mine.append(key)
        return {"kind": self.name, "key": key, "nbytes": buffer.numel(), "pid": os.getpid()}

    def register_source(self, buffer: torch.Tensor) -> None:
        _check_flat(buffer, "staging buffer")

    def open(self, descriptor: dict) -> Peer:
        if descriptor.get("kind") != self.name or descriptor.get("pid") != os.getpid():
            raise ValueError(f"local transport cannot open {descriptor!r} (another process or kind)")
        target = LocalTransport._registry.get(descriptor["key"])
        if target is None:
            raise ValueError(f"no local landing buffer {descriptor['key']}")
        return Peer(descriptor["key"], descriptor["nbytes"], descriptor, target)

    def submit(self, peer, src, src_offset_bytes, dst_offset_bytes, nbytes) -> WriteHandle:
        _check_range(peer, dst_offset_bytes, nbytes)
        peer.target.narrow(0, dst_offset_bytes, nbytes).copy_(src.narrow(0, src_offset_bytes, nbytes))
        return WriteHandle(None, DONE)

    def submit_many(self, peer, src, src_offsets, dst_offsets, sizes) -> WriteHandle:
        for s, d, n in zip(src_offsets, dst_offsets, sizes, strict=True):
            self.submit(peer, src, s, d, n)
        return WriteHandle(None, DONE)

    def submit_writes(self, peer, src, writes, after=None) -> list[WriteHandle]:
        return [self.submit(peer, src, s, d, n) for s, d, n in writes]

    def submit_group(self, jobs, src, after=None) -> list[list[WriteHandle]]:
        return [self.submit_writes(peer, src, writes, after) for peer, writes in jobs]

    def poll(self, handle: WriteHandle) -> int:
        return handle.state

    def close(self) -> None:
        for key in self._mine:
            LocalTransport._registry.pop(key, None)
        self._mine.clear()


class IpcTransport:
    """Same host, another process: CUDA/HIP IPC for GPU tensors, POSIX shared memory for CPU ones.

    The GPU descriptor carries torch's IPC handle (``torch.multiprocessing.reductions.reduce_tensor``)
    pickled and base64-encoded: the side channel runs on 127.0.0.1 between processes of one
    deployment, so the pickle is trusted input. GPU copies run on one side stream per source device;
    ``poll`` queries the copy's event.

    GPU completions are interprocess events from a ring of ``fence_events`` per copy stream, so a
    decode rank can query them itself (``fence``/``open_fence``): the stage's READIES go out at
    submit time. Reusing a ring event is safe because one stream runs every copy in order: an event
    re-recorded by a later group completes after every earlier copy (a query can only wait longer).
    """

    name = "ipc"

    def __init__(self, copy_on: str = "src", fence_events: int = 64) -> None:
        """``copy_on``: issue GPU copies on a stream of the source (``"src"``) or destination
        (``"dst"``) device. One copy stream per device: spreading a group's copies over 2 streams
        measured 0.39 of the device copy against 0.69 with one (H200 x2, 2026-11-29).
        ``fence_events``: interprocess completion events per copy stream (reused in turn)."""
        if copy_on not in ("src", "dst"):
            raise ValueError(f"copy_on must be 'src' or 'dst', got {copy_on!r}")
        if fence_events < 1:
            raise ValueError(f"fence_events must be >= 1, got {fence_events}")
        self.copy_on = copy_on
        self.fence_events = fence_events
        self._rings: dict[int, list[Any]] = {}        # device index -> its interprocess events
        self._ring_next: dict[int, int] = {}
        self._fence_tokens: dict[int, str] = {}       # id(event) -> exported handle (base64)
        self._fences_opened: dict[str, Any] = {}      # token -> event opened in this process
        self._shms: list[Any] = []       # our shared-memory segments (unlinked at close)
        self._opened: list[Any] = []     # peers' segments we attached
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._src_device: torch.device | None = None   # staging device (register_source): opens map there

    def allocate(self, nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
        device = torch.device(device)
        if device.type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        from multiprocessing import shared_memory

        shm = shared_memory.SharedMemory(create=True, size=nbytes)
        self._shms.append(shm)
        t = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
        t._kvpool_shm_name = shm.name  # type: ignore[attr-defined]
        return t

    def expose(self, buffer: torch.Tensor) -> dict:
        _check_flat(buffer, "landing buffer")
        if buffer.device.type == "cpu":
            name = getattr(buffer, "_kvpool_shm_name", None)
            if name is None:
                raise ValueError("IpcTransport exposes CPU memory from its own allocate() only (shared memory)")
            return {"kind": self.name, "shm": name, "nbytes": buffer.numel()}
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(buffer)
        return {"kind": self.name, "cuda": base64.b64encode(pickle.dumps(args)).decode(), "nbytes": buffer.numel()}

    def register_source(self, buffer: torch.Tensor) -> None:
        _check_flat(buffer, "staging buffer")
        if buffer.is_cuda:
            self._src_device = buffer.device

    def open(self, descriptor: dict) -> Peer:
        if descriptor.get("kind") != self.name:
            raise ValueError(f"ipc transport cannot open {descriptor!r}")
        nbytes = int(descriptor["nbytes"])
        if "shm" in descriptor:
            from multiprocessing import resource_tracker, shared_memory

            shm = shared_memory.SharedMemory(name=descriptor["shm"])
            # Python < 3.13 registers attached segments too and would unlink the owner's at our exit
            resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
            self._opened.append(shm)
            target = torch.frombuffer(shm.buf, dtype=torch.uint8, count=nbytes)
            return Peer(descriptor["shm"], nbytes, descriptor, target)
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = list(pickle.loads(base64.b64decode(descriptor["cuda"])))
        if self.copy_on == "src" and self._src_device is not None:
            # Map the peer's memory into the *writer's* device context (cudaIpcOpenMemHandle /
            # hipIpcOpenMemHandle on that device, peer access enabled by the open): copies from
            # local staging are then device-local copies over NVLink / xGMI. Opened on the owner's
            # device instead, the mapping is not peer-mapped for the writer's context and copies
            # ran at ~37 GB/s against ~370 GB/s (H200 x2, 2026-11-29). The tensor reports the
            # writer's device; its bytes live on the peer's GPU.
            args[_STORAGE_DEVICE] = self._src_device.index
        target = rebuild_cuda_tensor(*args)
        return Peer(uuid.uuid4().hex, nbytes, descriptor, target)

    def submit(self, peer, src, src_offset_bytes, dst_offset_bytes, nbytes) -> WriteHandle:
        _check_range(peer, dst_offset_bytes, nbytes)
        dst = peer.target.narrow(0, dst_offset_bytes, nbytes)
        s = src.narrow(0, src_offset_bytes, nbytes)
        if not (src.is_cuda or peer.target.is_cuda):
            dst.copy_(s)
            return WriteHandle(None, DONE)
        use_src = src.is_cuda and (self.copy_on == "src" or not peer.target.is_cuda)
        dev = src.device if use_src else peer.target.device
        stream = self._streams.get(dev.index)
        if stream is None:
            stream = self._streams[dev.index] = torch.cuda.Stream(device=dev)
        if src.is_cuda:
            stream.wait_stream(torch.cuda.current_stream(src.device))  # the gather that filled ``src``
        with torch.cuda.device(dev), torch.cuda.stream(stream):
            dst.copy_(s, non_blocking=True)
            ev = self._ring_event(dev.index)
            ev.record(stream)
        return WriteHandle(ev)

    def submit_many(self, peer, src, src_offsets, dst_offsets, sizes) -> WriteHandle:
        h = WriteHandle(None, DONE)
        for s, d, n in zip(src_offsets, dst_offsets, sizes, strict=True):
            h = self.submit(peer, src, s, d, n)
        return h  # one stream: the last event covers the batch

    def submit_writes(self, peer, src, writes, after=None) -> list[WriteHandle]:
        """All ``writes`` on the copy stream, adjacent ones merged into one ``copy_``, one event
        for the lot (every handle completes with it). GPU sources wait for ``after`` (else for the
        source device's current stream) on the device, not on the host."""
        return self.submit_group([(peer, writes)], src, after)[0]

    def submit_group(self, jobs, src, after=None) -> list[list[WriteHandle]]:
        """``submit_writes`` to several peers in one go: one stream switch, one wait for ``after``,
        the merged copies of every peer, **one** event that completes every handle (what a stage
        sends to all decode ranks for one request costs one call and one completion)."""
        for peer, writes in jobs:
            for _, d, n in writes:
                _check_range(peer, d, n)
        gpu = src.is_cuda or any(peer.target.is_cuda for peer, _ in jobs)
        if not gpu:
            out = []
            for peer, writes in jobs:
                for s, d, n in coalesce(writes):
                    peer.target.narrow(0, d, n).copy_(src.narrow(0, s, n))
                out.append([WriteHandle(None, DONE) for _ in writes])
            return out
        if src.is_cuda and self.copy_on == "src":
            return self._submit_on(src.device, jobs, src, after)
        # copies issued on the peers' devices: one group (stream, event) per peer
        return [self._submit_one(peer, src, writes, after) for peer, writes in jobs]

    def _submit_one(self, peer, src, writes, after) -> list[WriteHandle]:
        use_src = src.is_cuda and (self.copy_on == "src" or not peer.target.is_cuda)
        return self._submit_on(src.device if use_src else peer.target.device, [(peer, writes)], src, after)[0]

    def _submit_on(self, dev, jobs, src, after) -> list[list[WriteHandle]]:
        stream = self._streams.get(dev.index)
        if stream is None:
            stream = self._streams[dev.index] = torch.cuda.Stream(device=dev)
        if src.is_cuda:
            if after is not None:
                stream.wait_event(after)
            else:
                stream.wait_stream(torch.cuda.current_stream(src.device))
        here = dev.index == torch.cuda.current_device()
        copies = [(peer.target.narrow(0, d, n), src.narrow(0, s, n)) for peer, writes in jobs
                  for s, d, n in coalesce(writes)]
        with contextlib.nullcontext() if here else torch.cuda.device(dev), torch.cuda.stream(stream):
            for dst, s in copies:
                dst.copy_(s, non_blocking=True)
            ev = self._ring_event(dev.index)
            ev.record(stream)
        return [[WriteHandle(ev) for _ in writes] for _, writes in jobs]

    def _ring_event(self, device_index: int) -> Any:
        ring = self._rings.setdefault(device_index, [])
        i = self._ring_next.get(device_index, 0)
        self._ring_next[device_index] = (i + 1) % self.fence_events
        if i == len(ring):
            ring.append(torch.cuda.Event(interprocess=True))
        return ring[i]

    def fence(self, handle: WriteHandle) -> str | None:
        """The handle's completion as a token another process can ``open_fence`` (GPU copies;
        ``None`` for CPU copies, which are complete at submit)."""
        ev = handle.token
        if ev is None:
            return None
        tok = self._fence_tokens.get(id(ev))
        if tok is None:
            tok = self._fence_tokens[id(ev)] = base64.b64encode(ev.ipc_handle()).decode()
        return tok

    def open_fence(self, token: str, device: torch.device | str) -> Any:
        """The writer's completion event for ``token`` (opened once per process, then reused)."""
        ev = self._fences_opened.get(token)
        if ev is None:
            ev = torch.cuda.Event.from_ipc_handle(torch.device(device), base64.b64decode(token))
            self._fences_opened[token] = ev
        return ev

    def poll(self, handle: WriteHandle) -> int:
        if handle.state == RUNNING and handle.token.query():
            handle.state = DONE
        return handle.state

    def close(self) -> None:
        for shm in self._opened:
            shm.close()
        for shm in self._shms:
            try:
                shm.close()
            except BufferError:
                pass  # a tensor still views it; unlink anyway, the mapping goes with the process
            shm.unlink()
        self._opened.clear()
        self._shms.clear()


class MooncakeTransport:
    """Mooncake Transfer Engine, ``P2PHANDSHAKE`` metadata, one engine per process.

    Args:
        hostname: address peers reach this process at (its host part names the segment).
        force_tcp: True sets ``MC_FORCE_TCP=1`` before the engine starts (the engine would pick
            RDMA on a host with NICs otherwise); None leaves the environment as it is.
        allow_public_listeners: start the engine even outside a private network namespace, where
            its listeners are reachable on every interface of this machine (needed between hosts).
            False: ``PublicListenersRefused`` there (``kvpool.backend.pool.netns.check_listeners``),
            raised before the engine starts.
    Notes:
        ``MC_TCP_BIND_ADDRESS`` defaults to ``hostname``. Writes are ``transfer_submit_write`` polled
        with ``transfer_check_status`` (a dead peer reads -1 within about 1 s, a hung one after
        ``MC_TRANSFER_TIMEOUT``); a 0 id means the submit failed and is never polled (polling 0
        crashes the engine). ``submit_many`` is one ``batch_transfer_async_write``; its ``poll``
        blocks until the batch ends (the engine has no non-blocking batch query).
    """

    name = "mooncake"

    def __init__(
        self, hostname: str = "127.0.0.1", force_tcp: bool | None = None, allow_public_listeners: bool = False
    ) -> None:
        check_listeners(allow_public_listeners, "pass allow_public_listeners=True")
        if force_tcp:
            os.environ["MC_FORCE_TCP"] = "1"
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", hostname)
        from mooncake import engine as mc

        self._mc = mc
        self.engine = mc.TransferEngine()
        rc = self.engine.initialize(hostname, "P2PHANDSHAKE", "tcp", "")
        if rc != 0:
            raise RuntimeError(f"TransferEngine.initialize({hostname!r}, 'P2PHANDSHAKE') returned {rc}")
        self.segment = f"{hostname}:{self.engine.get_rpc_port()}"
        self._registered: list[int] = []

    def _check_device(self, t: torch.Tensor) -> None:
        if t.device.type != "cpu" and not (self._mc.SUPPORT_CUDA or self._mc.SUPPORT_HIP):
            raise ValueError("this Mooncake build has no GPU support: use host memory or the ipc transport")

    def allocate(self, nbytes: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def expose(self, buffer: torch.Tensor) -> dict:
        _check_flat(buffer, "landing buffer")
        self._check_device(buffer)
        rc = self.engine.register_memory(buffer.data_ptr(), buffer.numel())
        if rc != 0:
            raise RuntimeError(f"register_memory returned {rc}")
        self._registered.append(buffer.data_ptr())
        return {"kind": self.name, "segment": self.segment, "base": buffer.data_ptr(), "nbytes": buffer.numel()}

    def register_source(self, buffer: torch.Tensor) -> None:
        _check_flat(buffer, "staging buffer")
        self._check_device(buffer)
        rc = self.engine.register_memory(buffer.data_ptr(), buffer.numel())
        if rc != 0:
            raise RuntimeError(f"register_memory returned {rc}")
        self._registered.append(buffer.data_ptr())

    def open(self, descriptor: dict) -> Peer:
        if descriptor.get("kind") != self.name:
            raise ValueError(f"mooncake transport cannot open {descriptor!r}")
        return Peer(descriptor["segment"], int(descriptor["nbytes"]), descriptor, int(descriptor["base"]))

    def submit(self, peer, src, src_offset_bytes, dst_offset_bytes, nbytes) -> WriteHandle:
        _check_range(peer, dst_offset_bytes, nbytes)
        self._check_device(src)
        bid = self.engine.transfer_submit_write(
            peer.key, src.data_ptr() + src_offset_bytes, peer.target + dst_offset_bytes, nbytes
        )
        return WriteHandle(bid, RUNNING if bid else FAILED)

    def submit_writes(self, peer, src, writes, after=None) -> list[WriteHandle]:
        """One ``transfer_submit_write`` per write (each polled on its own); a GPU source is
        host-synchronized on ``after`` first (the engine reads memory outside any stream)."""
        _wait_host(after)
        return [self.submit(peer, src, s, d, n) for s, d, n in writes]

    def submit_group(self, jobs, src, after=None) -> list[list[WriteHandle]]:
        """``submit_writes`` per peer (one engine write per planned write), one host wait first."""
        _wait_host(after)
        return [self.submit_writes(peer, src, writes) for peer, writes in jobs]

    def submit_many(self, peer, src, src_offsets, dst_offsets, sizes) -> WriteHandle:
        base = src.data_ptr()
        bid = self.engine.batch_transfer_async_write(
            peer.key, [base + s for s in src_offsets], [peer.target + d for d in dst_offsets], list(sizes)
        )
        return WriteHandle(("batch", bid), RUNNING if bid else FAILED)

    def poll(self, handle: WriteHandle) -> int:
        if handle.state != RUNNING:
            return handle.state
        if isinstance(handle.token, tuple):
            rc = self.engine.get_batch_transfer_status([handle.token[1]])
            handle.state = DONE if rc == 0 else FAILED
        else:
            rc = self.engine.transfer_check_status(handle.token)
            if rc == 1:
                handle.state = DONE
            elif rc < 0:
                handle.state = FAILED
        return handle.state

    def close(self) -> None:
        for addr in self._registered:
            self.engine.unregister_memory(addr)
        self._registered.clear()


def make_transport(kind: str, **kw: Any) -> Transport:
    """``"mooncake"``, ``"ipc"`` or ``"local"``; keyword arguments go to the constructor."""
    kinds = {"mooncake": MooncakeTransport, "ipc": IpcTransport, "local": LocalTransport}
    if kind not in kinds:
        raise ValueError(f"transport must be one of {sorted(kinds)}, got {kind!r}")
    return kinds[kind](**kw)
