"""kernels/decode_layer"""
