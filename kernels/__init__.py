"""GPU kernels (Triton, portable to ROCm and CUDA) with pure-torch reference ops for the CPU.

Triton is imported only when a kernel launches on a GPU, so this package imports on any machine.
"""
