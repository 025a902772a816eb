"""KV geometry of a model: how many bytes one token's KV takes, per layer and per pipeline stage.

Contract:
    * A model has ``layers`` attention layers, each caching one record of ``record_bytes`` per token
      (GLM-5.x / DeepSeek MLA: 512 latent + 64 RoPE = 576 elements, 576 B in FP8).
    * ``mtp_layers`` draft (multi-token-prediction) layers cache the same record; they run on the last
      pipeline stage and carry layer ids ``layers .. layers + mtp_layers - 1``.
    * ``extra_records`` are additional per-token records on some layers only (the DSA indexer key:
      132 B FP8 + scale, padded to 144 B by ATOM, on 21 of GLM-5.2's 78 layers plus the MTP layer).
    * ``stage_layers`` splits the ``layers`` main layers into pipeline stages in order
      (e.g. 20/20/20/18). Bytes per token per stage sum the records of the stage's layers.

All quantities are plain integers; nothing here knows about devices or pools.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property


@dataclass(frozen=True)
class ExtraRecord:
    """A per-token record cached on some layers only (e.g. the DSA indexer key).

    Attributes:
        name: label, e.g. ``"indexer"``.
        bytes_per_token: bytes of the record per token per layer that carries it.
        layer_ids: layers carrying it; ids ``>= layers`` name MTP layers.
    """

    name: str
    bytes_per_token: int
    layer_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.bytes_per_token <= 0:
            raise ValueError(f"extra record {self.name!r}: bytes_per_token must be > 0, got {self.bytes_per_token}")
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"extra record {self.name!r}: layer_ids repeat a layer")
        if any(i < 0 for i in self.layer_ids):
            raise ValueError(f"extra record {self.name!r}: layer ids must be >= 0")


def every_kth_layer(layers: int, first_dense: int, k: int, offset: int) -> tuple[int, ...]:
    """Layer ids of an indexer schedule like GLM-5.2's ``index_topk_freq``.

    The first ``first_dense`` layers always carry the record, then every ``k``-th layer starting at
    ``offset`` (0-based). GLM-5.2: ``every_kth_layer(78, 3, 4, 6)`` gives 21 layers
    (0, 1, 2, 6, 10, ..., 74).
    """
    ids = list(range(min(first_dense, layers)))
    ids += [i for i in range(offset, layers, k) if i >= first_dense]
    return tuple(ids)


@dataclass(frozen=True)
class KVSpec:
    """KV geometry of one model under one pipeline split. See the module docstring."""

    model: str
    layers: int
    record_bytes: int
    stage_layers: tuple[int, ...]
    mtp_layers: int = 0
    extra_records: tuple[ExtraRecord, ...] = field(default_factory=tuple)
    page_tokens: int = 16

    def __post_init__(self) -> None:
        if self.layers <= 0:
            raise ValueError(f"layers must be > 0, got {self.layers}")
        if self.record_bytes <= 0:
            raise ValueError(f"record_bytes must be > 0, got {self.record_bytes}")
        if self.mtp_layers < 0:
            raise ValueError(f"mtp_layers must be >= 0, got {self.mtp_layers}")
        if self.page_tokens <= 0:
            raise ValueError(f"page_tokens must be > 0, got {self.page_tokens}")
        if not self.stage_layers or any(n <= 0 for n in self.stage_layers):
            raise ValueError(f"stage_layers must be positive counts, got {list(self.stage_layers)}")
        if sum(self.stage_layers) != self.layers:
            raise ValueError(
                f"stage_layers {list(self.stage_layers)} sum to {sum(self.stage_layers)}, "
                f"but the model has {self.layers} layers"
            )
        total = self.layers + self.mtp_layers
        for rec in self.extra_records:
            bad = [i for i in rec.layer_ids if i >= total]
            if bad:
                raise ValueError(
                    f"extra record {rec.name!r}: layer ids {bad} out of range 0..{total - 1}"
                )

    @property
    def stages(self) -> int:
        """Number of pipeline stages."""
        return len(self.stage_layers)

    def stage_layer_ids(self, stage: int) -> tuple[int, ...]:
        """Layer ids held by ``stage``; the last stage also holds the MTP layers."""
        if not 0 <= stage < self.stages:
            raise ValueError(f"stage {stage} out of range 0..{self.stages - 1}")
        start = sum(self.stage_layers[:stage])
        ids = list(range(start, start + self.stage_layers[stage]))
        if stage == self.stages - 1:
            ids += list(range(self.layers, self.layers + self.mtp_layers))
        return tuple(ids)

    def layer_bytes_per_token(self, layer: int) -> int:
        """Bytes one token caches on ``layer``: the main record plus any extra records there."""
        extra = sum(r.bytes_per_token for r in self.extra_records if layer in r.layer_ids)
        return self.record_bytes + extra

    @cached_property
    def stage_bytes_per_token(self) -> tuple[int, ...]:
        """Bytes per token held by each pipeline stage (one pool object per stage holds these)."""
        return tuple(
            sum(self.layer_bytes_per_token(layer) for layer in self.stage_layer_ids(s))
            for s in range(self.stages)
        )

    @property
    def bytes_per_token(self) -> int:
        """Total KV bytes per token over all layers (GLM-5.3 FP8 in the seed: 48,672 B)."""
        return sum(self.stage_bytes_per_token)

    def chunk_object_bytes(self, stage: int, chunk_tokens: int) -> int:
        """Size of one pool object: ``chunk_tokens`` tokens of ``stage``'s layers."""
        return self.stage_bytes_per_token[stage] * chunk_tokens

    def identity(self) -> dict:
        """Plain description of the byte layout, used to derive the key namespace."""
        return {
            "model": self.model,
            "layers": self.layers,
            "mtp_layers": self.mtp_layers,
            "record_bytes": self.record_bytes,
            "extra_records": [
                {"name": r.name, "bytes_per_token": r.bytes_per_token, "layer_ids": list(r.layer_ids)}
                for r in self.extra_records
            ],
            "stage_layers": list(self.stage_layers),
            "page_tokens": self.page_tokens,
        }
