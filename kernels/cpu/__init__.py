"""The CPU backend: batched torch paths, native C++ kernels (``csrc/``) and their loaders,
packed linears, and the CPU runtime (threads, pinning, OpenMP, niceness, allocator).

The engine reaches all of it through ``pdserve.kernels.ops`` only. This package file and
``cpus`` import no torch: the config and the CLI read CPU lists from there.
"""
