"""The overrides a run's flags stand for, shared by the CLI and the dashboard.

Contract: ``run_overrides(set_, duration=, seed=, sessions=, rps=)`` is the user's ``--set`` lines
followed by the ``section.field=value`` overrides that ``--duration``, ``--seed`` and
``--sessions``/``--rps`` stand for (each value checked against its field, ``kvpool.scenario.fields``).
Both ``--sessions`` and ``--rps`` raise ``kvpool.errors.UserError``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.errors import UserError


def run_overrides(set_: Sequence[str], *, duration: float | None = None, seed: int | None = None,
                  sessions: str | None = None, rps: str | None = None) -> list[str]:
    """The ``--set`` overrides that ``--duration``, ``--seed`` and ``--sessions``/``--rps`` stand for,
    after the user's own ``--set`` ones."""
    from kvpool.scenario.fields import check

    extra = list(set_)
    if duration is not None:
        extra.append(f"workload.duration_s={check('workload.duration_s', duration, '--duration')!r}")
    if seed is not None:
        extra.append(f"seed={check('seed', seed, '--seed')}")
    if sessions is not None and rps is not None:
        raise UserError("give --sessions (AgentX lanes) or --rps (production replay), not both")
    if sessions is not None:
        extra.append('workload.mode="agentx"')
    if rps is not None:
        extra.append('workload.mode="replay"')
    return extra
