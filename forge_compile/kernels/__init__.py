"""Triton kernels, one module per kernel family: a private @triton.jit kernel and its public launcher."""
