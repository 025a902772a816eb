"""The steps of a request's way through the simulated cluster, in order (``sim.lifecycle`` runs them):

``admit`` (the gate) -> route -> ``pages`` -> ``lookup`` (GPU prefix cache, pool,
``policy.hits``) -> ``restore`` (pool -> GPU per rank) -> ``compute`` (chunked prefill, full pages
committed) -> ``save`` (new chunks -> pool) beside ``handoff`` (prefill -> decode per stage) ->
first token -> decode -> finish. Each step module holds what its step needs of the world, built
once, and one entry point that takes the request (``sim.request.Request``) and what to do when
the step is done. ``nics`` (the pool's NIC paths) serves two steps; ``pages`` (the prefill's paged
KV and GPU prefix cache: a request waits for pages for its whole prompt before its lookup and
holds them until its hand-off and save end) serves lookup, compute and the end of the hand-off
and save.
"""
