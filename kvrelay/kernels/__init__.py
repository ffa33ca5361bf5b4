"""Compute kernels: native CPU kernels (C, built on first use) and Triton kernels for CUDA."""
