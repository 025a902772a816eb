"""The hand-off geometry prefill stages and decode engines of one scenario agree on.

Contract:
    * ``TRANSPORT``: the hand-off transport production mode uses (``"ipc"``: every worker runs on one
      host; CUDA/HIP IPC between GPUs, POSIX shared memory between CPU processes). A decode
      engine's ready file names it too (``"transport"``).
    * ``write_cap_bytes(scenario)``: the largest write, ``handoff.max_write_bytes`` capped at the
      8 MiB a landing slot holds; every decode rank's landing slot is this size.
    * ``stage_plan(scenario, stage, prompt_tokens)``: the ``HandoffPlan`` of prefill stage
      ``stage``'s share of a prompt: all ``prompt_tokens`` tokens from position 0, the stage's
      layers, ``model.record_bytes`` records, ``decode.dcp`` ranks, ``write_cap_bytes``.
    * ``stage_layer_start(scenario, stage)``: index of the stage's first layer in a decode rank's
      caches (which hold every layer in order).
"""

from __future__ import annotations

from kvpool.policy.layout import DEFAULT_MAX_WRITE_BYTES, HandoffPlan
from kvpool.scenario.model import Scenario

TRANSPORT = "ipc"


def write_cap_bytes(scenario: Scenario) -> int:
    return min(scenario.handoff.max_write_bytes, DEFAULT_MAX_WRITE_BYTES)


def stage_plan(scenario: Scenario, stage: int, prompt_tokens: int) -> HandoffPlan:
    return HandoffPlan(prompt_tokens, scenario.prefill.stage_layers[stage], scenario.model.record_bytes,
                       scenario.decode.dcp, write_cap_bytes(scenario), 0)


def stage_layer_start(scenario: Scenario, stage: int) -> int:
    return sum(scenario.prefill.stage_layers[:stage])
