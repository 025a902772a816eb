"""The steps of a request's way through the simulated cluster, in order (``sim.lifecycle`` runs them):

``admit`` (the gate) -> route -> ``lookup`` (GPU prefix cache, pool, ``policy.hits``) ->
``restore`` (pool -> GPU per rank) -> ``compute`` (chunked prefill, GPU cache insert) -> ``save``
(new chunks -> pool, in the background) -> ``handoff`` (prefill -> decode per stage) -> decode ->
finish. Each step module holds what its step needs of the world, built once, and one entry
point that takes the request (``sim.request.Request``) and what to do when the step is done.
``gpu`` (the GPU prefix cache's use and insert) and ``nics`` (the pool's NIC paths) serve two
steps each; ``pages`` (serve mode's paged KV: a request waits for pages for its whole prompt
before its lookup and holds them until its hand-off and save end) serves lookup, compute and the
end of the hand-off and save.
"""
