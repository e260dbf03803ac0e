"""moe_engine/startup"""
