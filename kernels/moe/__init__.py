"""kernels/moe"""
