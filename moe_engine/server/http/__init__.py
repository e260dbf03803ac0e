"""The OpenAI-compatible HTTP API (FastAPI + uvicorn), served beside gRPC over the same engine.

    state = HttpState(engine, served_model_name, status)
    server = HttpServer(build_app(state, max_body_bytes=...), host, port)
    await server.start(); ...; await server.stop()
"""

from moe_engine.server.http.app import HttpServer, build_app
from moe_engine.server.http.state import HttpState

__all__ = ["HttpServer", "HttpState", "build_app"]
