"""Which processes ``kvpool serve`` starts, on which devices, and how they find one another.

Contract:
    * ``build_plan(scenario, run_dir, router_port, devices=None) -> ServePlan``: one prefill engine
      and ``prefill.pp`` stage processes per prefill instance, one decode engine per decode
      instance driving ``decode.tp`` ranks, on the devices ``kvpool.scenario.derive.serve_devices``
      gives them (``devices``, default ``serve.devices``, in order, wrapping around).
    * Every process is started as ``python -m kvpool.backend.serve.<module> --plan PLAN --name NAME``
      (``Worker.argv``). It binds its listeners on 127.0.0.1 with port 0 and, once it serves, writes
      its ready file (``write_ready``): ``{"pid", "url" or "endpoint", ...}``. Whoever needs it
      waits for that file (``wait_ready``, bounded), so no port is chosen before it is bound.
    * ``ServePlan.pool_address``: where the Mooncake pool answers (``mooncake://HOST:RPC?metrics=M``,
      ``backend.pool.address``) when ``serve.pool = "mooncake"``; empty for the embedded pool. The
      supervisor starts or joins the pool (``backend.serve.pool_setup``) before it builds the plan.
    * ``ServePlan.to_json`` / ``from_json`` round-trip; ``write`` / ``read`` use ``run_dir/plan.json``.
    * ``worker_of_argv(role, argv) -> (plan, worker)``: a worker process's ``--plan PLAN --name
      NAME``; a plan that cannot be read, a name it lacks or a worker of another role is one
      ``error:`` line on stderr and ``SystemExit(2)``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from kvpool.scenario.derive import serve_devices
from kvpool.scenario.model import Scenario

#: Start order: a process may wait for the ready files of the roles before it.
ROLES = ("decode_engine", "prefill_stage", "prefill_engine")


@dataclass(frozen=True)
class Worker:
    """One process: ``role``, its instance (and stage), its devices (one per stage or rank)."""

    name: str
    role: str
    instance: int
    stage: int
    devices: tuple[str, ...]

    def argv(self, plan_path: Path) -> list[str]:
        return [sys.executable, "-m", f"kvpool.backend.serve.{self.role}", "--plan", str(plan_path), "--name", self.name]


@dataclass(frozen=True)
class ServePlan:
    scenario: dict
    run_dir: str
    router_port: int
    workers: tuple[Worker, ...]
    pool_address: str = ""

    def scenario_model(self) -> Scenario:
        return Scenario.model_validate(self.scenario)

    def by_role(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.role == role]

    def worker(self, name: str) -> Worker:
        for w in self.workers:
            if w.name == name:
                return w
        raise KeyError(f"no worker named {name!r} in the plan")

    def stages_of(self, instance: int) -> list[Worker]:
        return sorted((w for w in self.by_role("prefill_stage") if w.instance == instance), key=lambda w: w.stage)

    def ready_path(self, name: str) -> Path:
        return Path(self.run_dir) / f"{name}.ready.json"

    def log_path(self, name: str) -> Path:
        return Path(self.run_dir) / f"{name}.log"

    @property
    def path(self) -> Path:
        return Path(self.run_dir) / "plan.json"

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> ServePlan:
        workers = tuple(Worker(w["name"], w["role"], w["instance"], w["stage"], tuple(w["devices"])) for w in d["workers"])
        return cls(d["scenario"], d["run_dir"], d["router_port"], workers, d.get("pool_address", ""))

    def write(self) -> Path:
        Path(self.run_dir).mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1))
        os.replace(tmp, self.path)
        return self.path

    @classmethod
    def read(cls, path: str | Path) -> ServePlan:
        return cls.from_json(json.loads(Path(path).read_text()))


def build_plan(scenario: Scenario, run_dir: str | Path, router_port: int, devices: tuple[str, ...] | None = None,
               *, pool_address: str = "") -> ServePlan:
    """The processes of ``scenario`` (see the module docstring); ``pool_address`` is the Mooncake pool's."""
    placed = serve_devices(scenario, devices)
    workers: list[Worker] = []
    for i, stages in enumerate(placed.prefill):
        for s, dev in enumerate(stages):
            workers.append(Worker(f"prefill{i}-stage{s}", "prefill_stage", i, s, (dev,)))
        workers.append(Worker(f"prefill{i}", "prefill_engine", i, -1, ()))
    for j, ranks in enumerate(placed.decode):
        workers.append(Worker(f"decode{j}", "decode_engine", j, -1, ranks))
    return ServePlan(scenario.model_dump(mode="json"), str(run_dir), router_port, tuple(workers), pool_address)


def write_ready(path: Path, info: dict) -> None:
    """Announce that a process serves: ``info`` (with its pid) written atomically."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), **info}))
    os.replace(tmp, path)


def wait_ready(path: Path, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> dict:
    """The ready file's content once it exists; ``TimeoutError`` after ``timeout_s`` or when ``alive()`` is false."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        if not alive():
            raise TimeoutError(f"{path.name}: the process exited before it was ready")
        time.sleep(0.05)
    raise TimeoutError(f"{path.name}: not ready after {timeout_s:g} s")


def worker_of_argv(role: str, argv: list[str] | None = None) -> tuple[ServePlan, Worker]:
    """The plan and the worker a ``python -m kvpool.backend.serve.ROLE`` process serves (see the module docstring)."""
    ap = argparse.ArgumentParser(prog=f"python -m kvpool.backend.serve.{role}")
    ap.add_argument("--plan", required=True)
    ap.add_argument("--name", required=True)
    args = ap.parse_args(argv)
    try:
        plan = ServePlan.read(args.plan)
        worker = plan.worker(args.name)
    except (OSError, ValueError, KeyError) as e:
        reason = e.args[0] if isinstance(e, KeyError) else e
        print(f"error: --plan {args.plan} --name {args.name}: {reason}", file=sys.stderr)
        raise SystemExit(2) from None
    if worker.role != role:
        print(f"error: --name {args.name} is a {worker.role}, not a {role}", file=sys.stderr)
        raise SystemExit(2)
    return plan, worker
