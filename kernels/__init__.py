"""Attention, KV-cache and norm/rotary kernels: Triton for CUDA, pure torch for CPU.

Callers use ``kernels.ops`` only; ``kernels.reference`` holds the test oracles.
"""
