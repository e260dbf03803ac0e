"""kernels/native"""
