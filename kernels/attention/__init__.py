"""kernels/attention"""
