"""Access control and limits of the gRPC front end, over loopback with the fake engine core.

API key (missing, wrong, right; health exempt or not; moe-client's flag and environment
variable), mutual TLS with certificates made here (by `cryptography` and by `openssl`), the
refusal to listen on a non-loopback address unauthenticated, undecodable requests,
--max-prompt-tokens, --max-concurrent-streams, and checkpoints that would need pickle or remote
code.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_helpers import ServerThread, request
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from tls_certs import CertPaths, available_tools, make_certs

from moe_engine.cli import client as cli
from moe_engine.cli import serve as serve_cli
from moe_engine.errors import StartupError
from moe_engine.server.app import ServerOptions
from moe_engine.server.interceptors import ApiKeyInterceptor
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.server.security import API_KEY_ENV, is_loopback_host, resolve_api_key
from moe_engine.startup.config import EngineConfig, ModelConfig, SchedulerConfig

FAKE = "fake_core:FakeEngineCore"
FAKE_CONFIG = EngineConfig(ModelConfig(model="/fake", max_model_len=256))
KEY = "s3cret-Key_42"
GOOD = (("authorization", f"Bearer {KEY}"),)
MAX_PROMPT_TOKENS = 32
MAX_STREAMS = 2


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    options = ServerOptions(
        port=0,
        api_key=KEY,
        max_prompt_tokens=MAX_PROMPT_TOKENS,
        max_concurrent_streams=MAX_STREAMS,
    )
    handle = ServerThread(FAKE_CONFIG, options, core_factory=FAKE)
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> Iterator[pb_grpc.MoeEngineStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.MoeEngineStub(channel)


def _calls(stub: pb_grpc.MoeEngineStub):
    """One call of each MoeEngine method the fake core serves, taking metadata."""
    return {
        "Generate": lambda md: list(stub.Generate(request([5, 6], max_tokens=2), metadata=md)),
        "Abort": lambda md: stub.Abort(pb.AbortRequest(request_id="x"), metadata=md),
        "GetModelInfo": lambda md: stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=md),
        "GetServerStats": lambda md: stub.GetServerStats(pb.GetServerStatsRequest(), metadata=md),
    }


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ((), "missing API key"),
        ((("authorization", "Bearer wrong"),), "invalid API key"),
        ((("authorization", f"Bearer {KEY}x"),), "invalid API key"),
        ((("authorization", KEY),), "invalid API key"),  # no scheme
        ((("authorization", f"Basic {KEY}"),), "invalid API key"),
        ((("x-api-key", KEY),), "missing API key"),
    ],
    ids=["missing", "wrong", "longer", "no-scheme", "basic", "other-header"],
)
def test_bad_key_is_unauthenticated(
    server: ServerThread, stub: pb_grpc.MoeEngineStub, metadata: tuple, expected: str
) -> None:
    metrics = server.server.metrics.registry
    before = metrics.get_sample_value("moe_engine_num_unauthenticated_total")
    for name, call in _calls(stub).items():
        with pytest.raises(grpc.RpcError) as info:
            call(metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
        assert expected in info.value.details(), (name, info.value.details())
        assert KEY not in info.value.details()
    after = metrics.get_sample_value("moe_engine_num_unauthenticated_total")
    assert after == before + len(_calls(stub))


def test_right_key_is_served(stub: pb_grpc.MoeEngineStub) -> None:
    for md in (GOOD, (("authorization", f"bearer {KEY}"),)):
        calls = _calls(stub)
        responses = calls["Generate"](md)
        assert responses[-1].finished and responses[-1].usage.completion_tokens == 2
        assert calls["GetModelInfo"](md).architecture == "FakeEcho"
        assert calls["GetServerStats"](md).kv_blocks_total > 0
        answer = calls["Abort"](md)
        assert not answer.aborted and "'x' is not live" in answer.detail


def test_health_is_open_and_reflection_is_not(server: ServerThread) -> None:
    with grpc.insecure_channel(server.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_undecodable_request_is_invalid_argument(
    server: ServerThread, stub: pb_grpc.MoeEngineStub
) -> None:
    with grpc.insecure_channel(server.address) as channel:
        raw = channel.unary_stream(
            "/moe_engine.v1.MoeEngine/Generate",
            request_serializer=None,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        bad_utf8_stop = b"\x1a\x01\x05" + b"\x52\x02\xff\xfe"  # prompt_ids [5], stop b"\xff\xfe"
        for payload in (bad_utf8_stop, b"\xff\xff\xff\xff"):
            with pytest.raises(grpc.RpcError) as info:
                list(raw(payload, metadata=GOOD))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
            assert info.value.details().startswith("request:")
            assert dict(info.value.trailing_metadata())["moe-field"] == "request"
            # Without the key the payload is not even parsed.
            with pytest.raises(grpc.RpcError) as info:
                list(raw(payload))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    ok = list(stub.Generate(request([5], max_tokens=1), metadata=GOOD))
    assert ok[-1].finished


def test_max_prompt_tokens(stub: pb_grpc.MoeEngineStub) -> None:
    ok = list(stub.Generate(request([7] * MAX_PROMPT_TOKENS, max_tokens=1), metadata=GOOD))
    assert ok[-1].usage.prompt_tokens == MAX_PROMPT_TOKENS
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request([7] * (MAX_PROMPT_TOKENS + 1), max_tokens=1), metadata=GOOD))
    assert info.value.code() == grpc.StatusCode.OUT_OF_RANGE
    details = info.value.details()
    assert details.startswith("prompt:") and "--max-prompt-tokens" in details
    assert str(MAX_PROMPT_TOKENS) in details and str(MAX_PROMPT_TOKENS + 1) in details


def test_max_concurrent_streams_per_connection(
    server: ServerThread, stub: pb_grpc.MoeEngineStub
) -> None:
    # Four 40-step streams (about 0.4 s each) on one connection that allows two at a time.
    engine = server.server.engine
    calls = [
        stub.Generate(request([9, 10 + i], max_tokens=40, ignore_eos=True), metadata=GOOD)
        for i in range(4)
    ]
    results: list[list] = [[] for _ in calls]
    threads = [
        threading.Thread(target=lambda i=i: results[i].extend(calls[i])) for i in range(len(calls))
    ]
    for t in threads:
        t.start()
    peak = 0
    deadline = time.monotonic() + 30
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        peak = max(peak, engine.num_live_requests)
        time.sleep(0.005)
    for t in threads:
        t.join(5)
    assert peak == MAX_STREAMS
    assert [r[-1].usage.completion_tokens for r in results] == [40] * 4


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _batch_file(tmp_path: Path) -> Path:
    path = tmp_path / "requests.jsonl"
    lines = [{"prompt_ids": [5, 6], "max_tokens": 3}, {"prompt_ids": [7], "max_tokens": 2}]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def _batch_tokens(out: str) -> int:
    *results, summary = (json.loads(line) for line in out.splitlines())
    assert summary["num_errors"] == 0 and len(results) == 2, out
    return summary["output_tokens"]


def test_moe_client_sends_key_from_flag_or_env(
    server: ServerThread, capsys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    code, out, err = _cli(capsys, "--server", server.address, "stats", "--json")
    assert code == 1 and "UNAUTHENTICATED" in err and "missing API key" in err
    code, out, err = _cli(capsys, "--server", server.address, "--api-key", KEY, "info", "--json")
    assert code == 0, err
    assert json.loads(out)["architecture"] == "FakeEcho"
    monkeypatch.setenv(API_KEY_ENV, KEY)
    argv = ["--server", server.address, "generate", "--prompt-ids", "4,5", "--max-tokens", "3"]
    code, out, err = _cli(capsys, *argv, "--json")
    assert code == 0, err
    assert json.loads(out)["usage"]["completion_tokens"] == 3
    code, out, err = _cli(capsys, "--server", server.address, "batch", str(_batch_file(tmp_path)))
    assert code == 0 and _batch_tokens(out) == 5, err
    code, out, err = _cli(capsys, "--server", server.address, "--api-key", "nope", "stats")
    assert code == 1 and "invalid API key" in err
    code, out, err = _cli(capsys, "--server", server.address, "--api-key", "two words", "stats")
    assert code == 2 and "--api-key" in err and "printable ASCII" in err


def test_health_can_require_the_key() -> None:
    """--health-requires-api-key: the interceptor with no exempt methods, on a bare server."""

    async def main() -> None:
        server = grpc.aio.server(interceptors=[ApiKeyInterceptor(KEY, exempt_prefixes=())])
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                with pytest.raises(grpc.RpcError) as info:
                    await stub.Check(health_pb2.HealthCheckRequest())
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                reply = await stub.Check(health_pb2.HealthCheckRequest(), metadata=GOOD)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
        finally:
            await server.stop(0)

    asyncio.run(main())


# ----------------------------------------------------------------------------- TLS


@pytest.fixture(scope="module", params=["cryptography", "openssl"])
def tls(request, tmp_path_factory) -> Iterator[tuple[ServerThread, CertPaths]]:
    tool = request.param
    if tool not in available_tools():
        pytest.skip(f"{tool} is not installed")
    certs = make_certs(tmp_path_factory.mktemp(f"pki-{tool}"), tool)
    options = ServerOptions(
        port=0,
        tls_cert=str(certs.server_cert),
        tls_key=str(certs.server_key),
        tls_ca=str(certs.ca),
    )
    handle = ServerThread(FAKE_CONFIG, options, core_factory=FAKE)
    yield handle, certs
    handle.close()


def _tls_channel(address: str, certs: CertPaths, client_cert: bool = True) -> grpc.Channel:
    credentials = grpc.ssl_channel_credentials(
        root_certificates=certs.ca.read_bytes(),
        private_key=certs.client_key.read_bytes() if client_cert else None,
        certificate_chain=certs.client_cert.read_bytes() if client_cert else None,
    )
    return grpc.secure_channel(address, credentials)


@pytest.mark.ci_must_run  # skips without cryptography / openssl; CI has both
def test_mutual_tls_round_trip(
    tls: tuple[ServerThread, CertPaths], capsys, tmp_path: Path
) -> None:
    handle, certs = tls
    with _tls_channel(handle.address, certs) as channel:
        stub = pb_grpc.MoeEngineStub(channel)
        responses = list(stub.Generate(request([5, 6, 7], max_tokens=5, ignore_eos=True)))
        assert [t for r in responses for t in r.token_ids] == [6, 7, 8, 6, 7]
    flags = [
        "--server", handle.address, "--tls-ca", str(certs.ca),
        "--tls-cert", str(certs.client_cert), "--tls-key", str(certs.client_key),
    ]  # fmt: skip
    code, out, err = _cli(capsys, *flags, "info", "--json")
    assert code == 0, err
    assert json.loads(out)["architecture"] == "FakeEcho"
    code, out, err = _cli(capsys, *flags, "batch", str(_batch_file(tmp_path)))
    assert code == 0 and _batch_tokens(out) == 5, err


@pytest.mark.ci_must_run  # skips without cryptography / openssl; CI has both
def test_tls_refuses_plaintext_and_clients_without_certificate(
    tls: tuple[ServerThread, CertPaths],
) -> None:
    handle, certs = tls
    for channel in (
        grpc.insecure_channel(handle.address),
        _tls_channel(handle.address, certs, client_cert=False),
    ):
        with channel:
            stub = pb_grpc.MoeEngineStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# ------------------------------------------------------------ binding and startup checks


def test_loopback_hosts() -> None:
    for host in ("127.0.0.1", "localhost", "LOCALHOST", "::1", "[::1]", "127.1.2.3"):
        assert is_loopback_host(host), host
    for host in ("0.0.0.0", "::", "[::]", "10.0.0.1", "example.com", ""):
        assert not is_loopback_host(host), host


def test_non_loopback_needs_authentication() -> None:
    with pytest.raises(ValueError, match="--allow-insecure"):
        ServerOptions(host="0.0.0.0")
    ServerOptions(host="0.0.0.0", api_key=KEY)
    ServerOptions(host="0.0.0.0", allow_insecure=True)
    ServerOptions(host="0.0.0.0", tls_cert="c.pem", tls_key="k.pem", tls_ca="ca.pem")
    with pytest.raises(ValueError, match="--tls-key"):
        ServerOptions(tls_cert="c.pem")
    with pytest.raises(ValueError, match="--tls-cert"):
        ServerOptions(tls_ca="ca.pem")


def test_serve_flags_reach_the_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = serve_cli.build_parser().parse_args(
        ["--max-waiting-requests", "7", "--max-prompt-tokens", "9", "--max-concurrent-streams",
         "3", "--drain-timeout", "1.5", "--api-key", KEY, "--health-requires-api-key",
         "--host", "0.0.0.0"]
    )  # fmt: skip
    options = serve_cli.server_options_from_args(args)
    assert (options.max_prompt_tokens, options.max_concurrent_streams) == (9, 3)
    assert (options.drain_grace_s, options.api_key) == (1.5, KEY)
    assert options.health_requires_api_key and KEY not in repr(options)
    config = serve_cli.engine_config_from_args(args, "/model")
    assert config.scheduler.max_waiting == 7
    defaults = serve_cli.server_options_from_args(serve_cli.build_parser().parse_args([]))
    assert defaults.max_concurrent_streams == 1024 and defaults.drain_grace_s == 30
    assert defaults.api_key is None and defaults.max_prompt_tokens is None
    with pytest.raises(ValueError, match="max_waiting"):
        SchedulerConfig(max_waiting=0)


def test_api_key_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert resolve_api_key(None, None) is None
    key_file = tmp_path / "key"
    key_file.write_text(f"  {KEY}\n")
    assert resolve_api_key(None, str(key_file)) == KEY
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert resolve_api_key(None, None) == "from-env"
    assert resolve_api_key("from-flag", None) == "from-flag"
    with pytest.raises(ValueError, match="--api-key-file"):
        resolve_api_key(None, str(tmp_path / "missing"))
    key_file.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        resolve_api_key(None, str(key_file))


def _serve(capsys, monkeypatch: pytest.MonkeyPatch, *argv: str) -> tuple[int, str]:
    """`moe-serve ARGV` in this process (no server starts: each case fails before)."""
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    code = serve_cli.main(list(argv))
    return code, capsys.readouterr().err


def test_moe_serve_refuses_public_bind_without_key(
    tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The check comes before the model is looked at: the path does not even exist.
    argv = ("--host", "0.0.0.0", "--port", "0", "--model", str(tmp_path / "none"))
    code, err = _serve(capsys, monkeypatch, *argv)
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("moe-serve: error: refusing to listen on 0.0.0.0")
    assert "--api-key" in lines[0] and "--allow-insecure" in lines[0]
    # With a key the check passes (and the missing model is what fails).
    code, err = _serve(capsys, monkeypatch, *argv, "--api-key", KEY)
    assert code == 1 and "config.json" in err and "refusing" not in err


class _Trap:
    """Unpickling this creates `path`: proof that a pickle was loaded."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


def test_pickle_only_checkpoint_is_refused(
    qwen3_ckpt: Path, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = tmp_path / "bin-only"
    model.mkdir()
    (model / "config.json").write_text((qwen3_ckpt / "config.json").read_text())
    marker = tmp_path / "unpickled"
    (model / "pytorch_model.bin").write_bytes(pickle.dumps({"weights": _Trap(marker)}))
    code, err = _serve(capsys, monkeypatch, "--model", str(model), "--port", "0")
    assert code == 1
    assert "no weights found" in err and "*.safetensors" in err
    assert "pytorch_model.bin" in err and "never loaded" in err
    from moe_engine.core.build import build_engine_core

    with pytest.raises(StartupError, match="safetensors"):
        build_engine_core(EngineConfig(ModelConfig(str(model), max_model_len=64)))
    assert not marker.exists()


def test_remote_code_config_is_refused(tmp_path: Path) -> None:
    model = tmp_path / "remote-code"
    model.mkdir()
    marker = tmp_path / "remote-code-ran"
    (model / "evil_config.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PretrainedConfig\n"
        "class EvilConfig(PretrainedConfig):\n"
        "    model_type = 'evil'\n"
    )
    config = {"model_type": "evil", "auto_map": {"AutoConfig": "evil_config.EvilConfig"}}
    (model / "config.json").write_text(json.dumps(config))
    from moe_engine.core.build import build_engine_core

    with pytest.raises(ValueError, match="trust_remote_code"):
        build_engine_core(EngineConfig(ModelConfig(str(model), max_model_len=64)))
    assert not marker.exists()
