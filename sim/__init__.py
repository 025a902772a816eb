"""The SimPy simulator of a disaggregated prefill/decode cluster with a shared KV pool.

Runs the policy core (``kvpool.policy``) against simulated time and resources. Filled by the
workload and simulator issues; importable without SimPy for the workload layer.
"""
