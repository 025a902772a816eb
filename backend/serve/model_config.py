"""The reference model a scenario serves: ``ref_config(scenario) -> RefConfig``, the one place it is built.

Contract:
    * Layers and their split come from ``prefill.stage_layers``, the page size from
      ``model.page_tokens``, the shape and seed from ``[serve]``.
    * The DSA indexer: a ``model.extra_records`` entry named ``indexer`` puts it on that entry's
      layers, shaped by ``serve.index_heads``, ``serve.index_dim`` and ``serve.index_topk``; its
      ``bytes_per_token`` must be the indexer record of ``serve.index_dim`` elements of
      ``serve.cache_dtype`` (``refmodel.indexer_record_bytes``: 144 B for 128 FP8 or 64 bfloat16
      elements). Without it every layer is dense.
    * ``ServeConfigError`` (a ``ValueError``) when the scenario describes KV the reference model
      does not cache: ``model.record_bytes`` other than the MLA record of ``serve.cache_dtype``
      (1,152 B bfloat16, 576 B float8_e4m3fn), extra records other than the indexer, an indexer
      record of another size or on MTP layers, or MTP layers.
"""

from __future__ import annotations

import torch

from kvpool.backend.refmodel import INDEXER, KV_LORA_RANK, ROPE_DIM, RefConfig, indexer_record_bytes
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
    if m.mtp_layers:
        raise ServeConfigError("model.mtp_layers: the reference model has no MTP layers; set it to 0 to serve")
    return RefConfig(
        stage_layers=tuple(scenario.prefill.stage_layers), vocab=s.vocab, d_model=s.d_model, heads=s.heads,
        nope_dim=s.nope_dim, v_dim=s.v_dim, page_tokens=m.page_tokens, cache_dtype=dtype, seed=s.model_seed,
        ffn_dim=s.ffn_dim, indexer_layers=_indexer_layers(scenario, dtype), index_heads=s.index_heads,
        index_dim=s.index_dim, index_topk=s.index_topk,
    )


def _indexer_layers(scenario: Scenario, dtype: torch.dtype) -> tuple[int, ...]:
    """The layer ids of the ``model.extra_records`` entry named ``indexer`` (none: ``()``), checked."""
    m, s = scenario.model, scenario.serve
    other = [r.name for r in m.extra_records if r.name != INDEXER]
    if other:
        raise ServeConfigError(f"model.extra_records: the reference model caches the MLA record and the "
                               f"{INDEXER!r} record only; remove {', '.join(map(repr, other))} to serve")
    spec = scenario.kvspec()
    if not spec.extra_records:
        return ()
    rec = spec.extra_records[0]
    size = indexer_record_bytes(s.index_dim, dtype)
    if rec.bytes_per_token != size:
        raise ServeConfigError(f"model.extra_records {INDEXER}: bytes_per_token is {rec.bytes_per_token} but "
                               f"serve.index_dim {s.index_dim} of serve.cache_dtype {s.cache_dtype} makes a "
                               f"{size} B indexer record (the key, a 4 B scale, padding to 16 B)")
    return tuple(sorted(rec.layer_ids))
