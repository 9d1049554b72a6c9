"""Triton kernels for CUDA: attention, KV writes and block copies, RMSNorm, rotary.

Only ``pdserve.kernels.ops`` calls them (imported lazily, on the first CUDA tensor, so a
machine without triton never imports this package's modules). Each has a torch reference
in ``pdserve.kernels.reference``; ``python -m pdserve.kernels.triton.gpu_check`` checks and
times them on a GPU. Must stay free of torch at package level (nothing is imported here).
"""
