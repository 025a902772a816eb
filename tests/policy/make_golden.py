"""Regenerate tests/policy/data/chunk_keys_golden.json (only when the key format changes on purpose,
together with POOL_FORMAT_VERSION / CHAIN_PERSON): ``python tests/policy/make_golden.py``."""

import json
from pathlib import Path

from kvpool.policy.chunks import ChunkNaming, chain_seed, digests_from_blocks, digests_from_tokens, namespace_for
from kvpool.policy.kvspec import ExtraRecord, KVSpec, every_kth_layer

OUT = Path(__file__).parent / "data" / "chunk_keys_golden.json"


def cases() -> list[dict]:
    return [
        {"kind": "tokens", "tokens": list(range(600)), "chunk_tokens": 256, "scope": ""},
        {"kind": "tokens", "tokens": [7] * 32 + [-5, 2**31 - 1] * 8, "chunk_tokens": 16, "scope": ""},
        {"kind": "blocks", "block_ids": [3, 1, 4, 1, 5, 9, 2, 6, 5], "block_tokens": 64, "n_tokens": 560,
         "chunk_tokens": 256, "scope": "trace-0001"},
        {"kind": "blocks", "block_ids": [11, 12, 13], "block_tokens": 512, "n_tokens": 1400,
         "chunk_tokens": 256, "scope": ""},
    ]


def spec() -> KVSpec:
    return KVSpec("GLM-5.2", 78, 576, (20, 20, 20, 18), mtp_layers=1,
                  extra_records=(ExtraRecord("indexer", 144, every_kth_layer(78, 3, 4, 6) + (78,)),))


def expected(case: dict) -> dict:
    ns = namespace_for(spec(), case["chunk_tokens"])
    seed = chain_seed(ns, case["scope"])
    if case["kind"] == "tokens":
        ds = digests_from_tokens(case["tokens"], case["chunk_tokens"], seed)
    else:
        ds = digests_from_blocks(case["block_ids"], case["block_tokens"], case["n_tokens"], case["chunk_tokens"], seed)
    naming = ChunkNaming(ns, 4)
    return {"namespace": ns, "digests": [d.hex() for d in ds],
            "stage0_keys": [naming.object_key(d, 0) for d in ds], "groups": [naming.group_id(d) for d in ds]}


if __name__ == "__main__":
    OUT.parent.mkdir(exist_ok=True)
    rows = [json.dumps({"input": c, "expected": expected(c)}, separators=(",", ":")) for c in cases()]
    OUT.write_text("[\n" + ",\n".join(rows) + "\n]\n")
    print(f"wrote {OUT}")
