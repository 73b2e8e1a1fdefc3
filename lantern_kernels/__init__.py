"""Triton kernels for lantern's fused ops, one module per op; they arrive in a later issue."""
