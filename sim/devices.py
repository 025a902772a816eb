"""Workers that share a device slow one another: ``kvpool serve``'s workers on one GPU (or CPU).

Contract:
    * ``Device(name)``: the workers computing on one device now (``busy``); ``start()`` and
      ``stop()`` count a worker in and out, and every change calls the listeners (``listen``)
      except the worker that made it.
    * ``Placement(devices, slowdown_per_worker)``: one worker's place. ``factor()`` is
      ``1 + slowdown_per_worker x others``, where ``others`` is the most workers besides this one
      computing on one of its devices: a step that would take ``t`` alone takes ``t x factor()``.
      ``start()`` / ``stop()`` count this worker in and out of every one of its devices.
    * ``shared_devices(s, decode_slowdown, prefill_slowdown) -> (prefill, decode)``: per prefill
      instance one ``Placement`` per stage, per decode instance one ``Placement`` over its ranks'
      devices, on the devices ``kvpool serve`` gives them (``kvpool.scenario.derive.serve_devices``).
      ``sim.world`` places the instances so when the calibration measured ``sharing``.

The model: the calibration measured one decode step beside one prefill stage and one prefill
stage beside the decode (``backend.serve.calibrate``); each other worker computing on a device
adds that measured share to a step's time, whichever worker it is. A prefill stage's step is
priced when the stage starts it; the decode's step whenever a worker on its devices starts or
stops (``sim.instances``).
"""

from __future__ import annotations

from collections.abc import Callable

from kvpool.scenario.derive import serve_devices
from kvpool.scenario.model import Scenario


class Device:
    """The workers computing on one device (see the module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.busy = 0
        self._listeners: list[tuple[object, Callable[[], None]]] = []

    def listen(self, worker: object, changed: Callable[[], None]) -> None:
        """Call ``changed()`` whenever a worker other than ``worker`` starts or stops here."""
        self._listeners.append((worker, changed))

    def start(self, worker: object) -> None:
        self.busy += 1
        self._tell(worker)

    def stop(self, worker: object) -> None:
        if self.busy <= 0:
            raise RuntimeError(f"device {self.name}: a worker stopped that never started")
        self.busy -= 1
        self._tell(worker)

    def _tell(self, worker: object) -> None:
        for who, changed in self._listeners:
            if who is not worker:
                changed()


class Placement:
    """One worker on its devices, slowed by the others computing there (see the module docstring)."""

    def __init__(self, devices: list[Device], slowdown_per_worker: float) -> None:
        if not devices:
            raise ValueError("placement: a worker needs a device")
        self.devices = devices
        self.slowdown_per_worker = slowdown_per_worker
        self.computing = False

    def start(self) -> None:
        if self.computing:
            raise RuntimeError(f"placement on {self.devices[0].name}: started twice")
        self.computing = True
        for d in self.devices:
            d.start(self)

    def stop(self) -> None:
        if not self.computing:
            raise RuntimeError(f"placement on {self.devices[0].name}: stopped while not computing")
        self.computing = False
        for d in self.devices:
            d.stop(self)

    def others(self) -> int:
        """The most workers besides this one computing on one of its devices now."""
        mine = 1 if self.computing else 0
        return max(d.busy - mine for d in self.devices)

    def factor(self) -> float:
        return 1.0 + self.slowdown_per_worker * self.others()

    def listen(self, changed: Callable[[], None]) -> None:
        """Call ``changed()`` whenever another worker starts or stops on one of its devices."""
        for d in self.devices:
            d.listen(self, changed)


def shared_devices(s: Scenario, decode_slowdown: float, prefill_slowdown: float
                   ) -> tuple[list[list[Placement]], list[Placement]]:
    """Per prefill instance its stages' placements, per decode instance its placement (over its
    ranks' devices), on the devices ``kvpool serve`` gives them."""
    placed = serve_devices(s)
    devices: dict[str, Device] = {}

    def device(name: str) -> Device:
        return devices.setdefault(name, Device(name))

    prefill = [[Placement([device(d)], prefill_slowdown) for d in stages] for stages in placed.prefill]
    decode = [Placement([device(d) for d in dict.fromkeys(ranks)], decode_slowdown) for ranks in placed.decode]
    return prefill, decode
