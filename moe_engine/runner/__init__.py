"""moe_engine/runner"""
