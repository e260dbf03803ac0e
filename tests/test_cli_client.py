"""`moe-client` argument and batch-file parsing, without a server."""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc
import pytest

from moe_engine.cli import batch, client, request_fields, rpc_errors
from moe_engine.server.pb import moe_engine_pb2 as pb


def parse_error(capsys: pytest.CaptureFixture, *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        client.build_parser().parse_args(list(argv))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err  # one line, no usage block or traceback
    return err


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["generate", "--prompt-ids", "99999999999999999999"], "--prompt-ids"),
        (["generate", "--prompt-ids", "1,,2"], "--prompt-ids"),
        (["generate", "--prompt-ids", "1,2,"], "--prompt-ids"),
        (["generate", "--prompt-ids", "1", "--seed", "99999999999999999999999"], "--seed"),
        (["generate", "--prompt-ids", "1", "--max-tokens", "3000000000"], "--max-tokens"),
        (["generate", "--prompt-ids", "1", "--stop-token-ids", "1,,2"], "--stop-token-ids"),
        (["generate", "hi", "--stop", "\udcff\udcfe"], "--stop"),
        (["batch", "x.jsonl", "--concurrency", "0"], "--concurrency"),
        (["batch", "x.jsonl", "--concurrency", "-3"], "--concurrency"),
    ],
)
def test_bad_flags_are_one_line_naming_the_flag(capsys, argv: list[str], flag: str) -> None:
    assert flag in parse_error(capsys, *argv)


@pytest.mark.parametrize(
    ("argv", "flag", "why"),
    [
        (["--timeout", "-1", "stats"], "--timeout", "> 0"),
        (["--timeout", "0", "stats"], "--timeout", "> 0"),
        (["--timeout", "nan", "stats"], "--timeout", "> 0"),
        (["--timeout", "inf", "stats"], "--timeout", "finite"),
        (["--timeout", "soon", "stats"], "--timeout", "number of seconds"),
        (["--server", "127.0.0.1", "stats"], "--server", "'127.0.0.1' has no port"),
        (["--server", "localhost:", "stats"], "--server", "has no port"),
        (["--server", "::1", "stats"], "--server", "brackets"),
        (["--server", "[::1]", "stats"], "--server", "has no port"),
        (["--server", ":50051", "stats"], "--server", "has no host"),
        (["--server", "h:0", "stats"], "--server", "1..65535"),
        (["--server", "h:65536", "stats"], "--server", "1..65535"),
        (["--server", "h:http", "stats"], "--server", "1..65535"),
    ],
)
def test_bad_connection_flags(capsys, argv: list[str], flag: str, why: str) -> None:
    err = parse_error(capsys, *argv)
    assert f"argument {flag}:" in err and why in err, err
    # main() exits the same way before any connection is tried
    with pytest.raises(SystemExit) as info:
        client.main(argv)
    assert info.value.code == 2


def test_good_connection_flags() -> None:
    parser = client.build_parser()
    args = parser.parse_args(["stats"])
    assert args.server == "127.0.0.1:50051" and args.timeout is None
    for server in ("localhost:1", "10.0.0.7:65535", "[::1]:50051", "my-host.example:8080"):
        args = parser.parse_args(["--server", server, "--timeout", "0.25", "info"])
        assert args.server == server and args.timeout == 0.25
    assert "port is required" in parser.format_help()


@pytest.mark.parametrize("command", [["stats"], ["info"], ["health", "--wait", "5"],
                                     ["generate", "hi"], ["batch", "reqs.jsonl"]])
def test_connection_flags_after_the_subcommand(command: list[str]) -> None:
    """`moe-client health --server H:P` works as `moe-client --server H:P health`; given on
    both sides, the one after the subcommand wins; absent after it, the one before stays."""
    parser = client.build_parser()
    after = parser.parse_args([*command, "--server", "h:7", "--timeout", "2", "--tls",
                               "--api-key", "k"])
    assert (after.server, after.timeout, after.tls, after.api_key) == ("h:7", 2.0, True, "k")
    both = parser.parse_args(["--server", "a:1", "--timeout", "3", *command, "--server", "b:2"])
    assert (both.server, both.timeout, both.tls) == ("b:2", 3.0, False)
    before = parser.parse_args(["--server", "a:1", *command])
    assert before.server == "a:1" and before.api_key is None


def test_bad_server_after_the_subcommand_names_the_flag(capsys) -> None:
    err = parse_error(capsys, "health", "--server", "nohost")
    assert "argument --server:" in err and "has no port" in err, err


def test_stop_takes_one_value_per_flag(capsys) -> None:
    """`--stop $'\\n' "Hello"`: the prompt is not swallowed as a second stop string."""
    parser = client.build_parser()
    args = parser.parse_args(["generate", "--stop", "\n", "Hello"])
    request = client.request_from_args(args)
    assert request.text == "Hello" and list(request.stop) == ["\n"]
    args = parser.parse_args(["generate", "--stop", "a", "--stop", "b c", "--stop=-x", "Hi"])
    request = client.request_from_args(args)
    assert request.text == "Hi" and list(request.stop) == ["a", "b c", "-x"]
    args = parser.parse_args(["generate", "Hi"])
    assert args.stop is None and list(client.request_from_args(args).stop) == []
    # two values after one --stop: the second is the prompt, a third is an error
    args = parser.parse_args(["generate", "--stop", "a", "b"])
    assert args.stop == ["a"] and args.text == "b"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--stop", "a", "b", "c"])
    capsys.readouterr()
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "repeat the flag for several (--stop a --stop b)" in help_text


def test_good_flags_build_a_request() -> None:
    args = client.build_parser().parse_args(
        ["generate", "--prompt-ids", "1, 2,3", "--seed", str(2**63 - 1), "--stop", "\n"]
    )
    request = client.request_from_args(args)
    assert list(request.prompt_ids.ids) == [1, 2, 3]
    assert request.seed == 2**63 - 1 and list(request.stop) == ["\n"]


def test_detokenizer_flags_build_a_request() -> None:
    parse = client.build_parser().parse_args
    plain = client.request_from_args(parse(["generate", "x"]))
    assert not plain.HasField("include_stop_str_in_output")
    assert not plain.HasField("skip_special_tokens")
    args = parse(["generate", "x", "--include-stop-str-in-output", "--no-skip-special-tokens"])
    request = client.request_from_args(args)
    assert request.include_stop_str_in_output and request.HasField("skip_special_tokens")
    assert not request.skip_special_tokens


def test_batch_stop_string_is_one_stop_string() -> None:
    request = batch.parse_batch_line('{"prompt_ids": [1], "stop": "rz"}')
    assert list(request.stop) == ["rz"]
    request = batch.parse_batch_line('{"prompt": "hi", "stop": ["a", "b"], "seed": 7}')
    assert list(request.stop) == ["a", "b"] and request.seed == 7 and request.text == "hi"


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"prompt_ids": [1], "max_tokens": "5"}', ["max_tokens", "integer", '"5"']),
        ('{"prompt_ids": [1], "ignore_eos": "false"}', ["ignore_eos", "true or false"]),
        ('{"prompt_ids": [1], "stop_token_ids": 61}', ["stop_token_ids", "array of integers"]),
        ('{"prompt_ids": [1], "stop_token_ids": [1, "2"]}', ["stop_token_ids[1]", "integer"]),
        ('{"prompt_ids": [1], "temperature": "hot"}', ["temperature", "number"]),
        ('{"prompt_ids": [1], "seed": 1e30}', ["seed", "integer"]),
        ('{"prompt_ids": [1], "top_k": 99999999999}', ["top_k", "32-bit"]),
        ('{"prompt_ids": "1,2"}', ["prompt_ids", "array of integers"]),
        ('{"prompt": ["hi"]}', ["prompt", "string"]),
        ("[1, 2]", ["JSON object", "array"]),
        ('"hello"', ["JSON object", "string"]),
        ("{nope", ["not valid JSON"]),
        ('{"prompt_ids": [1], "bogus": 1}', ["unknown request fields", "bogus"]),
    ],
)
def test_batch_line_type_errors(line: str, expected: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        batch.parse_batch_line(line)
    for text in expected:
        assert text in str(info.value), str(info.value)


def test_load_batch_reports_every_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt_ids": [1]}\n\n{"prompt_ids": [1], "max_tokens": "5"}\n[1]\n')
    with pytest.raises(batch.BatchFileError) as info:
        batch.load_batch(path)
    problems = info.value.problems
    assert len(problems) == 2
    assert "line 3" in problems[0] and "max_tokens" in problems[0]
    assert "line 4" in problems[1]


def test_batch_main_exits_2_on_bad_file(tmp_path: Path, capsys) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"prompt_ids": [1], "stop_token_ids": 61}\n')
    assert client.main(["--server", "127.0.0.1:1", "batch", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.strip().splitlines() == [
        f"error: {path}: line 1: stop_token_ids: expected an array of integers, got 61 (an integer)"
    ]


def test_message_dict_keeps_64_bit_integers_numbers() -> None:
    stats = pb.ServerStats(num_preemptions=2**40, kv_blocks_total=8, kv_cache_usage=0.5)
    data = client.message_dict(stats)
    assert data["num_preemptions"] == 2**40 and data["num_aborted"] == 0
    assert data["kv_blocks_total"] == 8 and data["kv_cache_usage"] == 0.5


class _Err(grpc.RpcError):
    def code(self):
        return grpc.StatusCode.RESOURCE_EXHAUSTED

    def details(self):
        return "SERVER: Received message larger than max (99 vs. 10)"


def test_transport_size_refusal_hints_at_flag() -> None:
    assert "--max-message-bytes" in rpc_errors.error_text(_Err())


class _InterruptedCall:
    cancelled = False

    def __iter__(self):
        yield pb.GenerateResponse(text="partial")
        raise KeyboardInterrupt

    def cancel(self):
        _InterruptedCall.cancelled = True


class _Stub:
    def Generate(self, request, timeout=None):  # noqa: N802
        return _InterruptedCall()


def test_ctrl_c_cancels_the_stream_and_exits_130(capsys) -> None:
    args = client.build_parser().parse_args(["generate", "hi"])
    request = client.request_from_args(args)
    assert client.cmd_generate(args, _Stub(), request) == 130
    assert _InterruptedCall.cancelled
    captured = capsys.readouterr()
    assert captured.out == "partial\n" and captured.err == ""


def test_parse_ids_type() -> None:
    assert request_fields.parse_ids("4,5") == [4, 5]
    with pytest.raises(argparse.ArgumentTypeError):
        request_fields.parse_ids("")


class _Unavailable(grpc.RpcError):
    def __init__(self, details: str) -> None:
        self._details = details

    def code(self):
        return grpc.StatusCode.UNAVAILABLE

    def details(self):
        return self._details


@pytest.mark.parametrize(
    ("details", "hint"),
    [
        (
            "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:7: "
            "Failed to connect to remote host: Connection refused",
            "the server may not be running at h:7",
        ),
        ("errors resolving h:7: [hostname lookup error]", "the host h of h:7 does not resolve"),
        ("failed to connect to all addresses; Ssl handshake failed: WRONG_VERSION", "--tls"),
        ("server unavailable: the model is still loading", None),  # the server answered
    ],
)
def test_unavailable_hints(details: str, hint: str | None) -> None:
    text = rpc_errors.error_text(_Unavailable(details), "h:7")
    assert text.startswith(f"UNAVAILABLE: {details}")
    if hint is None:
        assert text == f"UNAVAILABLE: {details}"
    else:
        assert hint in text, text


@pytest.mark.parametrize("command", [["stats"], ["info"], ["generate", "hi"]])
def test_nothing_listening_suggests_the_server_is_not_running(capsys, command) -> None:
    import socket

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    assert client.main(["--server", address, "--timeout", "10", *command]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: UNAVAILABLE") and len(err.strip().splitlines()) == 1
    assert f"the server may not be running at {address}" in err, err


def test_generate_help_shows_every_default(capsys) -> None:
    from moe_engine.sampling_params import SamplingParams

    with pytest.raises(SystemExit) as info:
        client.main(["generate", "--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    d = SamplingParams()
    for flag, value in (
        ("--max-tokens", d.max_tokens),
        ("--min-tokens", d.min_tokens),
        ("--temperature", d.temperature),
        ("--top-p", d.top_p),
        ("--top-k", d.top_k),
    ):
        assert f"(default: {value})" in text.split(f"{flag} ", 2)[-1].split(" --")[0], flag
    sub = next(a for a in client.build_parser()._actions if a.dest == "command")
    generate = sub.choices["generate"]
    for action in generate._actions:
        if action.option_strings and action.dest != "help":
            assert "(default: " in (action.help or ""), action.option_strings


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--n", "0"], "--n: n must be in [1, 128], got 0"),
        (["--temperature", "-1"], "--temperature: temperature must be a finite number >= 0"),
        (["--min-tokens", "5", "--max-tokens", "2"], "--min-tokens: min_tokens (5) must be <="),
    ],
)
def test_generate_refuses_a_bad_sampling_flag_before_sending(flags, expected, capsys) -> None:
    """A value SamplingParams refuses is one line naming the flag, exit status 2, no server
    needed (none listens at the address)."""
    code = client.main(["--server", "127.0.0.1:9", "generate", "hi", *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and expected in err, err
