"""The SimPy simulator of a disaggregated prefill/decode cluster with a shared KV pool.

Runs the policy core (``kvpool.policy``) against simulated time and resources, driven by the
replay schedules of the workload layer (``kvpool.workload``).
"""
