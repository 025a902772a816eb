"""Measured cost curves (``kvpool calibrate``) as a cost model: the one interface the simulator reads them through.

Contract:
    * ``load_calibration(path) -> Calibration`` reads a calibration file (JSON, ``FORMAT`` and a
      version of ``READ_VERSIONS``; ``kvpool calibrate`` writes ``VERSION``) and checks every part
      the cost model uses; a bad file is one ``CalibrationError`` naming the file and the field.
    * ``CalibratedCost(cal, fallback)`` implements ``sim.cost.CostModel``:
        - ``prefill_step_s(items)``: the measured per-stage step time ``prefill.step_s[i][j]`` over
          (computed tokens ``prefill.new_tokens[i]``, cached context ``prefill.cached_tokens[j]``),
          bilinear inside the grid, at (the step's tokens, their token-weighted context), times
          ``prefill.replay_scale`` (version 3: the replay phase's measured stage time over the
          grid's, ``sim.replay_fit``; 1 without a replay phase; a version 2 file has none: 1);
        - ``decode_step_s(batch, context)``: the measured steps (``decode.samples``), piecewise
          linear: per measured batch size, the line through its steps over the context per
          sequence (``context / batch``), and between two measured batch sizes linear in the batch,
          inside the measured batch and context range (``decode.fit``, one plane over all of
          them, stays in the file unread: it under-predicts long batches, 39.7 against 49.7 ms at
          two sequences of 4,096 tokens on cpu-tiny);
        - ``pool_load_s(nbytes)``: ``restore.fixed_s + nbytes / restore.bytes_per_s`` (per rank,
          the NIC's share taken out: the simulator's links price it) inside the measured sizes;
        - ``unpack_s(nbytes)``: half of the measured hand-off fit at ``nbytes x stages``
          (``handoff.fixed_s + bytes / handoff.bytes_per_s``), so that the hand-off step's gather
          plus scatter, ``2 x unpack_s(bytes / stages)``, is the measured hand-off;
        - ``pack_s(nbytes)``: ``save.fixed_s + nbytes / save.bytes_per_s`` (per rank, the NIC's
          share taken out, as for ``pool_load_s``) inside the measured sizes;
        - outside a curve's measured range the ``fallback`` (the analytic model) answers, and the
          call is counted in ``fallbacks`` (per curve): the run reports them.
      ``control_plane_s``: the measured fixed time per request outside prefill, hand-off and the
      first token (``overheads.control_plane_s``), used instead of ``cost.control_plane_s``;
      ``sharing``: how much one worker computing beside it slows a decode step and a prefill stage
      on a shared device (``sharing.*_slowdown_per_worker``; ``None`` in a file without the section),
      which ``sim.devices`` applies.
    * Steps of a pipeline: the file's prefill step is one stage's share (a single-step request's
      prefill time over ``prefill.pp``), as ``sim.instances.PrefillInstance`` overlaps the stages.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.sim.cost import CostModel

FORMAT = "kvpool-calibration"
VERSION = 3
#: the versions this kvpool reads: 2 (no ``prefill.replay_scale``: 1) and 3
READ_VERSIONS = (2, 3)


class CalibrationError(ValueError):
    """A calibration file that cannot be used; the message names the file and the field."""


@dataclass(frozen=True)
class Sharing:
    """How much workers on one device slow one another (``backend.serve.calibrate``'s sharing phase):
    the share of its time alone that one other worker computing beside it adds to a step."""

    decode_slowdown_per_worker: float
    prefill_slowdown_per_worker: float


@dataclass(frozen=True)
class Calibration:
    path: str
    device: str
    prefill_pp: int
    new_tokens: tuple[int, ...]
    cached_tokens: tuple[int, ...]
    prefill_step_s: tuple[tuple[float, ...], ...]   # [new][cached]
    prefill_scale: float                             # prefill.replay_scale (1 in a version 2 file)
    decode_lines: tuple[tuple[int, float, float], ...]  # (batch, s at no context, s per token per sequence)
    decode_batch: tuple[int, int]                   # measured range
    decode_context: tuple[int, int]
    restore_fixed_s: float
    restore_bytes_per_s: float
    restore_bytes: tuple[int, int]
    handoff_fixed_s: float
    handoff_bytes_per_s: float
    handoff_bytes: tuple[int, int]
    save_fixed_s: float
    save_bytes_per_s: float
    save_bytes: tuple[int, int]
    stages: int
    control_plane_s: float
    sharing: Sharing | None  # None: the file has no sharing section
    raw: dict = field(repr=False, compare=False, default_factory=dict)


def _get(doc: dict, path: str, where: str):
    node = doc
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise CalibrationError(f"{where}: missing field {path}")
        node = node[part]
    return node


def _num(doc: dict, path: str, where: str, *, positive: bool = False) -> float:
    v = _get(doc, path, where)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (positive and v == 0):
        raise CalibrationError(f"{where}: field {path} must be a finite number {'> 0' if positive else '>= 0'}, got {v!r}")
    return float(v)


def _axis(doc: dict, path: str, where: str) -> tuple[int, ...]:
    v = _get(doc, path, where)
    if not (isinstance(v, list) and len(v) >= 2 and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
            and all(a < b for a, b in zip(v, v[1:]))):
        raise CalibrationError(f"{where}: field {path} must be at least two increasing integers >= 0, got {v!r}")
    return tuple(v)


def _range(doc: dict, path: str, where: str) -> tuple[int, int]:
    v = _get(doc, path, where)
    if not (isinstance(v, list) and len(v) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v)
            and 0 <= v[0] <= v[1]):
        raise CalibrationError(f"{where}: field {path} must be [low, high] with 0 <= low <= high, got {v!r}")
    return (v[0], v[1])


def _decode_lines(samples: object, where: str) -> tuple[tuple[int, float, float], ...]:
    """Per measured batch size with steps at two or more contexts: the least-squares line of its
    step time over the context per sequence, ``(batch, intercept_s, slope_s)``, by batch."""
    if not isinstance(samples, list):
        raise CalibrationError(f"{where}: field decode.samples must be a list of measured steps")
    by_batch: dict[int, list[tuple[float, float]]] = {}
    for i, x in enumerate(samples):
        ok = isinstance(x, dict) and all(isinstance(x.get(k), (int, float)) and not isinstance(x.get(k), bool)
                                         and math.isfinite(x[k]) and x[k] > 0 for k in ("batch", "context_tokens", "step_s"))
        if not ok or int(x["batch"]) != x["batch"]:
            raise CalibrationError(f"{where}: field decode.samples[{i}] must have a whole batch > 0, "
                                   "context_tokens > 0 and step_s > 0")
        by_batch.setdefault(int(x["batch"]), []).append((x["context_tokens"] / x["batch"], float(x["step_s"])))
    lines = []
    for b, pts in sorted(by_batch.items()):
        xs = [p for p, _ in pts]
        if max(xs) == min(xs):
            continue
        mx, my = sum(xs) / len(pts), sum(t for _, t in pts) / len(pts)
        slope = sum((p - mx) * (t - my) for p, t in pts) / sum((p - mx) ** 2 for p in xs)
        lines.append((b, my - slope * mx, slope))
    if not lines:
        raise CalibrationError(f"{where}: field decode.samples must hold some batch size at two contexts or more")
    return tuple(lines)


def _between_batches(lines: tuple[tuple[int, float, float], ...], batch: int, per_seq_tokens: float) -> float:
    """A step of ``batch`` sequences of ``per_seq_tokens`` each: the measured batch sizes' lines at
    that context, linear in the batch between the two around it (the nearest one beyond them)."""
    batches = [b for b, _, _ in lines]
    hi = min(len(lines) - 1, bisect_right(batches, batch))
    lo = max(0, hi - 1) if batches[hi] > batch else hi
    (b0, a0, k0), (b1, a1, k1) = lines[lo], lines[hi]
    s0, s1 = a0 + k0 * per_seq_tokens, a1 + k1 * per_seq_tokens
    t = (batch - b0) / (b1 - b0) if b1 != b0 else 0.0
    return max(1e-9, s0 + (s1 - s0) * t)


def parse_calibration(doc: object, where: str) -> Calibration:
    """A ``Calibration`` from a parsed file (``where`` names it in errors)."""
    if not isinstance(doc, dict):
        raise CalibrationError(f"{where}: not a JSON object")
    if doc.get("format") != FORMAT:
        raise CalibrationError(f"{where}: field format must be {FORMAT!r}, got {doc.get('format')!r}")
    version = doc.get("version")
    if isinstance(version, bool) or version not in READ_VERSIONS:
        raise CalibrationError(f"{where}: field version must be one of {', '.join(map(str, READ_VERSIONS))} "
                               f"(the formats this kvpool reads: re-run kvpool calibrate), got {version!r}")
    new, cached = _axis(doc, "prefill.new_tokens", where), _axis(doc, "prefill.cached_tokens", where)
    grid = _get(doc, "prefill.step_s", where)
    if not (isinstance(grid, list) and len(grid) == len(new) and all(isinstance(row, list) and len(row) == len(cached)
                                                                     for row in grid)):
        raise CalibrationError(f"{where}: field prefill.step_s must be {len(new)} rows of {len(cached)} numbers "
                               "(prefill.new_tokens x prefill.cached_tokens)")
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise CalibrationError(f"{where}: field prefill.step_s[{i}][{j}] must be a number > 0, got {v!r}")
    pp = int(_num(doc, "prefill.pp", where, positive=True))
    return Calibration(
        path=where, device=str(_get(doc, "device.name", where)), prefill_pp=pp,
        new_tokens=new, cached_tokens=cached, prefill_step_s=tuple(tuple(float(v) for v in row) for row in grid),
        prefill_scale=_num(doc, "prefill.replay_scale", where, positive=True) if version >= 3 else 1.0,
        decode_lines=_decode_lines(_get(doc, "decode.samples", where), where),
        decode_batch=_range(doc, "decode.batch_range", where), decode_context=_range(doc, "decode.context_range", where),
        restore_fixed_s=_num(doc, "restore.fit.fixed_s", where),
        restore_bytes_per_s=_num(doc, "restore.fit.bytes_per_s", where, positive=True),
        restore_bytes=_range(doc, "restore.bytes_range", where),
        handoff_fixed_s=_num(doc, "handoff.fit.fixed_s", where),
        handoff_bytes_per_s=_num(doc, "handoff.fit.bytes_per_s", where, positive=True),
        handoff_bytes=_range(doc, "handoff.bytes_range", where),
        save_fixed_s=_num(doc, "save.fit.fixed_s", where),
        save_bytes_per_s=_num(doc, "save.fit.bytes_per_s", where, positive=True),
        save_bytes=_range(doc, "save.bytes_range", where), stages=pp,
        control_plane_s=_num(doc, "overheads.control_plane_s", where), sharing=_sharing(doc, where), raw=doc)


def _sharing(doc: dict, where: str) -> Sharing | None:
    if "sharing" not in doc:
        return None
    return Sharing(_num(doc, "sharing.decode_slowdown_per_worker", where),
                   _num(doc, "sharing.prefill_slowdown_per_worker", where))


#: The largest calibration file read (one is a few KiB: grids of a few dozen points per curve).
MAX_CALIBRATION_BYTES = 16 << 20


def load_calibration(path: str | Path) -> Calibration:
    """The calibration file ``path`` (a regular file of at most ``MAX_CALIBRATION_BYTES``), checked."""
    from kvpool.inputs import InputFileError, read_regular

    where = str(path)
    try:
        data = read_regular(path, MAX_CALIBRATION_BYTES, "a calibration file")
    except InputFileError as e:
        msg = str(e)
        if msg.endswith(": no such file"):
            msg = f"{where}: no such calibration file (cost.calibration)"
        raise CalibrationError(msg) from None
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CalibrationError(f"{where}: not a readable JSON file ({e})") from None
    except RecursionError:
        raise CalibrationError(f"{where}: not a readable JSON file (nested too deeply)") from None
    return parse_calibration(doc, where)


def _bilinear(xs: tuple[int, ...], ys: tuple[int, ...], grid, x: float, y: float) -> float | None:
    """``grid`` (rows over ``xs``, columns over ``ys``) at (x, y); ``None`` outside [xs] x [ys]."""
    if not (xs[0] <= x <= xs[-1] and ys[0] <= y <= ys[-1]):
        return None
    i = min(len(xs) - 2, bisect_right(xs, x) - 1)
    j = min(len(ys) - 2, bisect_right(ys, y) - 1)
    tx = (x - xs[i]) / (xs[i + 1] - xs[i])
    ty = (y - ys[j]) / (ys[j + 1] - ys[j])
    top = grid[i][j] * (1 - ty) + grid[i][j + 1] * ty
    bot = grid[i + 1][j] * (1 - ty) + grid[i + 1][j + 1] * ty
    return top * (1 - tx) + bot * tx


class CalibratedCost:
    """The measured curves of ``cal``, ``fallback`` outside them (see the module docstring)."""

    def __init__(self, cal: Calibration, fallback: CostModel, nic_bytes_s: float) -> None:
        self.cal = cal
        self.fallback = fallback
        self.nic_bytes_s = nic_bytes_s
        self.control_plane_s = cal.control_plane_s
        self.sharing = cal.sharing
        self.calls: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()

    def _miss(self, curve: str) -> None:
        self.fallbacks[curve] += 1

    def prefill_step_s(self, tokens_and_context: list[tuple[int, int]]) -> float:
        self.calls["prefill"] += 1
        tokens = sum(t for t, _ in tokens_and_context)
        ctx = sum(t * c for t, c in tokens_and_context) / tokens if tokens else 0.0
        c = self.cal
        got = _bilinear(c.new_tokens, c.cached_tokens, c.prefill_step_s, tokens, ctx)
        if got is None:
            self._miss("prefill")
            return self.fallback.prefill_step_s(tokens_and_context)
        return got * c.prefill_scale

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        self.calls["decode"] += 1
        c = self.cal
        if not (c.decode_batch[0] <= batch <= c.decode_batch[1] and c.decode_context[0] <= context_tokens <= c.decode_context[1]):
            self._miss("decode")
            return self.fallback.decode_step_s(batch, context_tokens)
        return _between_batches(c.decode_lines, batch, context_tokens / batch)

    def unpack_s(self, nbytes: int) -> float:
        c = self.cal
        total = nbytes * c.stages
        if not self._measured("handoff", total, c.handoff_bytes):
            return self.fallback.unpack_s(nbytes)
        return (c.handoff_fixed_s + total / c.handoff_bytes_per_s) / 2

    def pack_s(self, nbytes: int) -> float:
        c = self.cal
        if not self._measured("save", nbytes, c.save_bytes):
            return self.fallback.pack_s(nbytes)
        return self._beyond_the_nic(c.save_fixed_s + nbytes / c.save_bytes_per_s, nbytes)

    def pool_load_s(self, nbytes: int) -> float:
        c = self.cal
        if not self._measured("restore", nbytes, c.restore_bytes):
            return self.fallback.pool_load_s(nbytes)
        return self._beyond_the_nic(c.restore_fixed_s + nbytes / c.restore_bytes_per_s, nbytes)

    def _measured(self, curve: str, nbytes: int, bytes_range: tuple[int, int]) -> bool:
        """Count a call of ``curve``; whether ``nbytes`` lies in its measured range (else a fallback)."""
        self.calls[curve] += 1
        inside = bytes_range[0] <= nbytes <= bytes_range[1]
        if not inside:
            self._miss(curve)
        return inside

    def _beyond_the_nic(self, measured_s: float, nbytes: int) -> float:
        """A measured pool transfer less the time of its bytes on the NIC (the simulator's links price that)."""
        return max(0.0, measured_s - nbytes / self.nic_bytes_s)

    def fallback_lines(self) -> list[str]:
        """One line per curve that the analytic model answered for, empty when none."""
        return [f"cost.calibration {self.cal.path}: {n} of {self.calls[k]} {k} costs lay outside the measured range "
                f"and used the analytic model" for k, n in sorted(self.fallbacks.items()) if n]
