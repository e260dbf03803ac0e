"""The committed gRPC stubs in moe_engine/server/pb/ match proto/moe_engine.proto exactly."""

from __future__ import annotations

from pathlib import Path

import pytest

from moe_engine.server.pb import regenerate


def test_committed_stubs_match_proto(tmp_path: Path) -> None:
    grpc_tools = pytest.importorskip("grpc_tools")
    del grpc_tools
    from importlib.metadata import version

    committed = regenerate.PB_DIR / "moe_engine_pb2_grpc.py"
    made_with = next(
        line.split("'")[1]
        for line in committed.read_text().splitlines()
        if line.startswith("GRPC_GENERATED_VERSION")
    )
    installed = version("grpcio-tools")
    if installed != made_with:
        pytest.skip(f"stubs were generated with grpcio-tools {made_with}; {installed} installed")
    written = regenerate.generate_stubs(tmp_path)
    for path in written:
        fresh = path.read_bytes()
        old = (regenerate.PB_DIR / path.name).read_bytes()
        assert fresh == old, (
            f"{path.name} is stale: run `python -m moe_engine.server.pb.regenerate`"
        )


def test_grpc_stub_imports_its_sibling_relatively() -> None:
    text = (regenerate.PB_DIR / "moe_engine_pb2_grpc.py").read_text()
    assert "from . import moe_engine_pb2" in text
    from moe_engine.server.pb import moe_engine_pb2_grpc

    assert hasattr(moe_engine_pb2_grpc, "MoeEngineStub")
