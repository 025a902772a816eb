"""The DSA indexer the indexer tests put on cpu-tiny: GLM-5.2's schedule (the first 3 layers, then
every 4th from layer 6), so layers 0, 1, 2 of cpu-tiny's 4, at top-32 so short prompts select."""

INDEXER = 'model.extra_records=[{name="indexer", bytes_per_token=144, first_dense_layers=3, every_k=4, offset=6}]'
TOPK = 32
#: the ``--set`` overrides of the indexer: its layers, top-k, heads and key width (144 B records)
INDEXER_SETS = [INDEXER, f"serve.index_topk={TOPK}", "serve.index_heads=4", "serve.index_dim=64"]
#: cpu-tiny's bytes per token with it: 4 layers of 1,152 B latents and 3 indexer records of 144 B
TOKEN_BYTES = 4 * 1152 + 3 * 144
