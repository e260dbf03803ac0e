"""moe_engine/offline"""
