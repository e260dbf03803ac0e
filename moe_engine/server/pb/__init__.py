"""Generated gRPC stubs for `proto/moe_engine.proto` (regenerate with `regenerate.py`)."""
