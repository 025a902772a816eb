"""Production mode: ``kvpool serve`` runs real prefill and decode workers behind one router.

Processes (every one started, watched and stopped by the supervisor, which keeps their pids):

    supervisor + router   ``supervisor``, ``router``: the HTTP front door on 127.0.0.1:PORT
                          (OpenAI ``/v1/completions``, ``/v1/models``, ``/health``, ``/metrics``),
                          the admission gate (``policy.admission``) and the routing
                          (``policy.routing``), the same objects the simulator drives.
    prefill engine        ``prefill_engine``: one per prefill instance. The scheduler side: block
                          tables and the GPU prefix cache shared by its stages (as one KV cache
                          manager drives every pipeline stage), the store connector's scheduler
                          (lookup, all-stage hit, load and save plans), chunked-prefill batching up
                          to ``prefill.max_batched_tokens``. HTTP on 127.0.0.1 for the router.
    prefill stage         ``prefill_stage``: one per pipeline stage, on its device. Its layers'
                          paged KV, the connector's worker side (pool reads into registered
                          buffers, ``kernels.unpack``; ``kernels.pack``, pool writes with group
                          ids), the layers' compute, and the hand-off sender
                          (``backend.handoff.PrefillStage``). Hidden states go to the next stage.
    decode engine         ``decode_engine``: one per decode instance, driving its TP x DCP ranks
                          (``backend.handoff.DecodeRank`` each, on their devices): hand-off
                          landing, continuous batching of every running sequence up to
                          ``decode.max_seqs``, greedy tokens streamed back. HTTP on 127.0.0.1.

A request (``protocol`` holds every message):

    client -> router            POST /v1/completions (text or token ids, max_tokens, stream)
    router                      gate: reserve prompt + output tokens on a decode instance
                                (or wait, or reject); route: pick a prefill instance of
                                the decode instance's group
    router -> decode engine     POST /expect      pages allocated, every rank asks the chosen
                                                  prefill instance's stages for its part
    router -> prefill engine    POST /prefill     lookup, restore, compute, save, hand-off; answers
                                                  the first token and a transfer descriptor
    router -> decode engine     POST /generate    the descriptor and the first token in; tokens
                                                  stream back as NDJSON lines
    router -> client            the tokens (server-sent events when ``stream=true``)
    router                      gate: release the reservation

See ``docs/serve.md``.
"""
