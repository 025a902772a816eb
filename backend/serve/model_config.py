"""The reference model a scenario serves: ``ref_config(scenario) -> RefConfig``, the one place it is built.

Contract:
    * Layers and their split come from ``prefill.stage_layers``, the page size from
      ``model.page_tokens``, the shape and seed from ``[serve]``.
    * ``ServeConfigError`` (a ``ValueError``) when the scenario describes KV the reference model
      does not cache: ``model.record_bytes`` other than the MLA record of ``serve.cache_dtype``
      (1,152 B bfloat16, 576 B float8_e4m3fn), extra records, or MTP layers.
"""

from __future__ import annotations

import torch

from kvpool.backend.refmodel import KV_LORA_RANK, ROPE_DIM, RefConfig
from kvpool.backend.serve.tokens import EOS_TOKEN  # noqa: F401  (the model's end token, defined once)
from kvpool.scenario.model import Scenario

DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn}



class ServeConfigError(ValueError):
    """The scenario cannot be served by the reference model; the message names the field."""


def ref_config(scenario: Scenario) -> RefConfig:
    m, s = scenario.model, scenario.serve
    dtype = DTYPES[s.cache_dtype]
    record = (KV_LORA_RANK + ROPE_DIM) * torch.empty((), dtype=dtype).element_size()
    if m.record_bytes != record:
        raise ServeConfigError(f"model.record_bytes is {m.record_bytes} but serve.cache_dtype {s.cache_dtype} "
                               f"caches {record} B per token per layer (the 512 + 64 MLA record)")
    if m.extra_records:
        raise ServeConfigError("model.extra_records: the reference model caches the MLA record only; remove them to serve")
    if m.mtp_layers:
        raise ServeConfigError("model.mtp_layers: the reference model has no MTP layers; set it to 0 to serve")
    return RefConfig(
        stage_layers=tuple(scenario.prefill.stage_layers), vocab=s.vocab, d_model=s.d_model, heads=s.heads,
        nope_dim=s.nope_dim, v_dim=s.v_dim, page_tokens=m.page_tokens, cache_dtype=dtype, seed=s.model_seed,
        ffn_dim=s.ffn_dim,
    )
