"""The hand-off geometry prefill stages and decode engines of one scenario agree on.

Contract:
    * ``TRANSPORT``: the hand-off transport production mode uses (``"ipc"``: every worker runs on one
      host; CUDA/HIP IPC between GPUs, POSIX shared memory between CPU processes). A decode
      engine's ready file names it too (``"transport"``).
    * ``write_cap_bytes(scenario)``: the largest write, ``handoff.max_write_bytes`` capped at the
      8 MiB a landing slot holds; every decode rank's landing slot is this size.
    * A stage's KV crosses as *parts*, one ``HandoffPlan`` each (a plan has one record size): the
      latents of its layers (``model.record_bytes`` each) and, with the DSA indexer (the
      ``model.extra_records`` entry named ``indexer``), the indexer records of its indexer layers.
      Each part has its own sender id on the decode ranks: stage ``s``'s latents are sender ``s``,
      its indexer records sender ``prefill.pp + s`` (``index_sender``); ``senders(scenario)`` is how
      many ids a decode rank serves (``pp``, or ``2 * pp`` with the indexer), its landing slots
      split evenly between them.
    * A decode rank's caches, as the hand-off sees them, are every layer's latent in layer order,
      then every indexer layer's indexer cache in layer order (``DcpCaches.handoff_caches``).
    * ``stage_plan(scenario, stage, prompt_tokens)``: the ``HandoffPlan`` of prefill stage
      ``stage``'s latents of a prompt: all ``prompt_tokens`` tokens from position 0, the stage's
      layers, ``model.record_bytes`` records, ``decode.dcp`` ranks, ``write_cap_bytes``.
      ``stage_layer_start(scenario, stage)``: index of the stage's first latent in a decode rank's
      caches.
    * ``stage_index_plan(scenario, stage, prompt_tokens)``: the same for the stage's indexer
      records (``None`` when the stage has no indexer layer); ``stage_index_start``: index of the
      stage's first indexer cache in a decode rank's caches.
    * ``stage_parts(scenario, stage, prompt_tokens) -> {sender: (plan, layer_start)}``: both.
      ``stage_bytes_per_token(scenario, stage)``: the bytes per token the parts carry, the
      stage's ``KVSpec.stage_bytes_per_token`` (layers x latent + indexer layers x indexer record).
"""

from __future__ import annotations

from kvpool.policy.layout import DEFAULT_MAX_WRITE_BYTES, HandoffPlan
from kvpool.scenario.model import Scenario

TRANSPORT = "ipc"
#: The DSA indexer's record name in ``model.extra_records``.
INDEXER = "indexer"


def write_cap_bytes(scenario: Scenario) -> int:
    return min(scenario.handoff.max_write_bytes, DEFAULT_MAX_WRITE_BYTES)


def indexer_layers(scenario: Scenario) -> tuple[int, ...]:
    """Layer ids carrying the indexer, increasing (none: ``()``)."""
    recs = [r for r in scenario.kvspec().extra_records if r.name == INDEXER]
    return tuple(sorted(recs[0].layer_ids)) if recs else ()


def indexer_record_bytes(scenario: Scenario) -> int:
    """Bytes per token of the indexer record (0 without the indexer)."""
    recs = [r for r in scenario.kvspec().extra_records if r.name == INDEXER]
    return recs[0].bytes_per_token if recs else 0


def senders(scenario: Scenario) -> int:
    """Sender ids one decode rank serves: ``prefill.pp``, twice that with the indexer."""
    return scenario.prefill.pp * (2 if indexer_layers(scenario) else 1)


def index_sender(scenario: Scenario, stage: int) -> int:
    """The sender id of stage ``stage``'s indexer records."""
    return scenario.prefill.pp + stage


def _stage_range(scenario: Scenario, stage: int) -> range:
    start = stage_layer_start(scenario, stage)
    return range(start, start + scenario.prefill.stage_layers[stage])


def stage_index_layers(scenario: Scenario, stage: int) -> int:
    """How many of stage ``stage``'s layers carry the indexer."""
    mine = _stage_range(scenario, stage)
    return sum(1 for li in indexer_layers(scenario) if li in mine)


def stage_plan(scenario: Scenario, stage: int, prompt_tokens: int) -> HandoffPlan:
    return HandoffPlan(prompt_tokens, scenario.prefill.stage_layers[stage], scenario.model.record_bytes,
                       scenario.decode.dcp, write_cap_bytes(scenario), 0)


def stage_layer_start(scenario: Scenario, stage: int) -> int:
    return sum(scenario.prefill.stage_layers[:stage])


def stage_index_plan(scenario: Scenario, stage: int, prompt_tokens: int) -> HandoffPlan | None:
    n = stage_index_layers(scenario, stage)
    if not n:
        return None
    return HandoffPlan(prompt_tokens, n, indexer_record_bytes(scenario), scenario.decode.dcp,
                       write_cap_bytes(scenario), 0)


def stage_index_start(scenario: Scenario, stage: int) -> int:
    first = _stage_range(scenario, stage).start
    return scenario.model.layers + sum(1 for li in indexer_layers(scenario) if li < first)


def stage_parts(scenario: Scenario, stage: int, prompt_tokens: int) -> dict[int, tuple[HandoffPlan, int]]:
    parts = {stage: (stage_plan(scenario, stage, prompt_tokens), stage_layer_start(scenario, stage))}
    index = stage_index_plan(scenario, stage, prompt_tokens)
    if index is not None:
        parts[index_sender(scenario, stage)] = (index, stage_index_start(scenario, stage))
    return parts


def stage_bytes_per_token(scenario: Scenario, stage: int) -> int:
    return sum(plan.layers * plan.record_bytes for plan, _ in stage_parts(scenario, stage, 1).values())
