"""The policy core: pure decisions that the simulator and the real backend both execute.

Modules (stdlib + numpy only; a test forbids simpy, torch, triton, mooncake and streamlit here):
    kvspec     KV geometry: bytes per token per layer and per pipeline stage
    chunks     chained chunk keys, object keys per (chunk, stage), group ids per chunk
    hits       GPU / pool / computed split of a prompt under the all-stage rule
    eviction   grouped pool bookkeeping with pluggable eviction (LRU, LFU, FIFO), string keys
    grouptable the same policy over integer group ids in numpy (the simulator's hot path)
    admission  the KV admission gate in front of decode
    routing    power-of-two and session-affinity prefill routing, decode-aware decode choice
    pagecache  the prefill's paged KV: pages held by requests in flight, the prefix cache's LRU
    prefill_steps chunked prefill's step packing: the tokens each request computes in a step
    prefill_request one request's prefill lifecycle: its load, compute ranges, save floor, record fields
    layout     PP -> DCP token mapping, gather and write plans for the prefill -> decode handoff

Time is always passed in (``now``), randomness always comes from a passed-in seeded RNG.
"""
