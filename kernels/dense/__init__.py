"""kernels/dense"""
