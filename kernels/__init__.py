"""Attention, KV-cache and norm/rotary kernels: Triton for CUDA, pure torch for CPU.

Callers use ``pdserve.kernels.ops`` only; ``pdserve.kernels.reference`` holds the test oracles.
"""
