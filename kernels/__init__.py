"""Compute kernels, installed as ``ninfer_kernels``.

Every operation has a plain-torch reference (the correctness oracle, used on CPU) and,
where it pays, a Triton kernel used on CUDA. :mod:`ninfer_kernels.ops` picks one.
"""
