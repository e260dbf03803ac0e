"""moe_engine/core"""
