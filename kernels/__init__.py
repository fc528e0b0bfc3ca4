"""Triton kernels."""

HAS_TRITON = False
