"""Attention, KV-cache and layer kernels, by backend.

- ``ops``: the one dispatch module the engine and kvtransfer call (CUDA tensors to Triton,
  CPU tensors to the CPU backend) and the device runtime the model runner owns;
- ``triton/``: Triton kernels for CUDA;
- ``cpu/``: batched torch paths, native C++ kernels and the CPU runtime;
- ``reference``: pure-torch references, the test oracles of every kernel.

Imports no torch here: torch-free modules of the backends (CPU lists) load without it.
"""
