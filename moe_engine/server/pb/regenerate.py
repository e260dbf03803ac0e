"""Regenerate the committed Python stubs from `proto/moe_engine.proto`.

Run from a source checkout (needs grpcio-tools, a dev dependency):

    python -m moe_engine.server.pb.regenerate

`grpc_tools.protoc` writes `moe_engine_pb2.py`, `moe_engine_pb2.pyi` and `moe_engine_pb2_grpc.py`;
the last one imports its sibling as a top-level module, which is rewritten to a package-relative
import so the stubs work inside `moe_engine.server.pb`.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

#: The committed stubs live beside this file.
PB_DIR = Path(__file__).resolve().parent
#: `proto/` at the root of a source checkout.
PROTO_DIR = PB_DIR.parents[2] / "proto"
PROTO_NAME = "moe_engine.proto"
STUB_NAMES = ("moe_engine_pb2.py", "moe_engine_pb2.pyi", "moe_engine_pb2_grpc.py")

_TOP_LEVEL_IMPORT = "import moe_engine_pb2 as moe__engine__pb2"
_RELATIVE_IMPORT = "from . import moe_engine_pb2 as moe__engine__pb2"


def generate_stubs(out_dir: Path, proto_dir: Path = PROTO_DIR) -> list[Path]:
    """Run protoc on `proto_dir/moe_engine.proto` and write the three stubs into `out_dir`.

    Returns:
        The paths written, in `STUB_NAMES` order.

    Raises:
        RuntimeError: when protoc fails (its exit status is in the message).
        FileNotFoundError: when the .proto file is missing.
    """
    from grpc_tools import protoc

    proto = proto_dir / PROTO_NAME
    if not proto.is_file():
        raise FileNotFoundError(f"no {PROTO_NAME} in {proto_dir}")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{proto_dir}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(proto),
        ]
        status = protoc.main(args)
        if status != 0:
            raise RuntimeError(f"grpc_tools.protoc exited with status {status}")
        written = []
        for name in STUB_NAMES:
            text = (Path(tmp) / name).read_text()
            if name.endswith("_grpc.py"):
                if _TOP_LEVEL_IMPORT not in text:
                    raise RuntimeError(f"{name}: expected import line not found")
                text = text.replace(_TOP_LEVEL_IMPORT, _RELATIVE_IMPORT)
            path = out_dir / name
            path.write_text(text)
            written.append(path)
    return written


def main() -> int:
    for path in generate_stubs(PB_DIR):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
