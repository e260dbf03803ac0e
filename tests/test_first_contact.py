"""Messages a new user meets first (issue 13, part 5), checked without a running server: a broken
config.json, a path that does not exist, a Hugging Face hub id (not cached, and cached: loaded
from the hub cache's snapshot through its symlinks), a folder without weights, an int4 group
size that does not divide, a too-long prompt, the tokenizer's length warning, a port in use,
and `--version`."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

import moe_engine
from moe_engine.cli import serve as serve_cli
from moe_engine.core.validation import validate_request
from moe_engine.errors import ErrorCode, RequestError, StartupError
from moe_engine.models import checkpoint_shape, resolve_quant_config
from moe_engine.models.loader import load_model, safetensors_files
from moe_engine.sampling_params import SamplingParams
from moe_engine.startup.config import QuantConfig, read_config_json
from moe_engine.startup.model_path import hub_cache_dir, resolve_model_dir

REPO = Path(__file__).resolve().parent.parent
HUB_ID = "Qwen/Qwen3-30B-A3B"
_HUB_ENV = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, list[str]]:
    """`moe-serve ARGV` in this process: (exit status, stderr lines); each case fails before
    a port opens."""
    code = serve_cli.main([*argv, "--port", "0"])
    return code, capsys.readouterr().err.strip().splitlines()


@pytest.fixture
def hub_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No hub-cache variable set, HOME in tmp_path, and the working directory there too (so
    that "Qwen/Qwen3-30B-A3B" is not a relative path that exists)."""
    for name in _HUB_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


# --- config.json ----------------------------------------------------------------------------


def test_broken_config_json_names_the_file_and_the_position(tmp_path: Path, capsys) -> None:
    model = tmp_path / "broken"
    model.mkdir()
    (model / "config.json").write_text('{\n  "hidden_size": 64,\n  "num_hidden_layers": \n}\n')
    with pytest.raises(ValueError) as err:
        read_config_json(model)
    message = str(err.value)
    assert str(model / "config.json") in message and "not valid JSON" in message
    assert "line 4 column 1" in message, message
    with pytest.raises(ValueError, match="line 4 column 1"):
        checkpoint_shape(model)
    code, lines = _serve(capsys, "--model", str(model))
    assert code == 1 and len(lines) == 1, lines
    assert str(model / "config.json") in lines[0] and "line 4 column 1" in lines[0]


def test_config_json_that_is_not_an_object(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"expected a JSON object .*\[1, 2\]"):
        read_config_json(tmp_path)


# --- paths and hub ids ----------------------------------------------------------------------


def test_missing_path_says_it_does_not_exist(hub_env: Path, capsys) -> None:
    missing = hub_env / "no" / "such" / "dir"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_dir(str(missing))
    code, lines = _serve(capsys, "--model", str(missing))
    assert code == 1 and len(lines) == 1 and "does not exist" in lines[0], lines


def test_file_instead_of_directory(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="is a file"):
        resolve_model_dir(str(tmp_path / "model.safetensors"))


def test_hub_id_not_in_the_cache_says_nothing_is_downloaded(hub_env: Path, capsys) -> None:
    with pytest.raises(FileNotFoundError) as err:
        resolve_model_dir(HUB_ID)
    message = str(err.value)
    snapshots = hub_env / "home/.cache/huggingface/hub/models--Qwen--Qwen3-30B-A3B/snapshots"
    assert "never downloads" in message and f"hf download {HUB_ID}" in message
    assert f"--model {snapshots}/<hash>" in message, message
    code, lines = _serve(capsys, "--model", HUB_ID)
    assert code == 1 and len(lines) == 1 and "never downloads" in lines[0], lines
    from moe_engine import LLM
    from moe_engine.errors import StartupError

    with pytest.raises(StartupError, match="never downloads"):  # the offline API says the same
        LLM(HUB_ID)


def test_hub_cache_location_follows_the_environment(
    hub_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """huggingface_hub's order: HF_HUB_CACHE, HUGGINGFACE_HUB_CACHE, HF_HOME/hub,
    XDG_CACHE_HOME/huggingface/hub, ~/.cache/huggingface/hub."""
    assert hub_cache_dir() == hub_env / "home/.cache/huggingface/hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(hub_env / "xdg"))
    assert hub_cache_dir() == hub_env / "xdg/huggingface/hub"
    monkeypatch.setenv("HF_HOME", str(hub_env / "hf"))
    assert hub_cache_dir() == hub_env / "hf/hub"
    monkeypatch.setenv("HUGGINGFACE_HUB_CACHE", str(hub_env / "legacy"))
    assert hub_cache_dir() == hub_env / "legacy"
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_env / "cache"))
    assert hub_cache_dir() == hub_env / "cache"


def _fake_hub_snapshot(ckpt: Path, hub: Path, repo_id: str, commit: str) -> Path:
    """`ckpt` laid out as huggingface_hub caches a download: contents in blobs/<sha256>,
    snapshots/<commit>/<name> as relative symlinks to them, refs/main naming the commit."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    for path in sorted(ckpt.iterdir()):
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / digest).write_bytes(data)
        (snapshot / path.name).symlink_to(Path("../../blobs") / digest)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


def _write_tiny_tokenizer(path: Path, model_max_length: int) -> None:
    """A 4-word WordLevel tokenizer whose tokenizer_config.json says `model_max_length`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2, "c": 3}, "<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
        "model_max_length": model_max_length,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def test_hub_id_in_the_cache_loads_its_snapshot_through_symlinks(
    qwen3_ckpt: Path, hub_env: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    from transformers import AutoConfig

    from moe_engine.core.tokenizer import load_tokenizer
    from moe_engine.models import resolve_architecture

    source = hub_env / "source"
    source.mkdir()
    for path in qwen3_ckpt.iterdir():
        (source / path.name).write_bytes(path.read_bytes())
    _write_tiny_tokenizer(source, 1024)
    monkeypatch.setenv("HF_HOME", str(hub_env / "hf"))
    hub = hub_env / "hf" / "hub"
    _fake_hub_snapshot(source, hub, "tiny-org/qwen3-tiny", "a" * 40)  # an older snapshot
    snapshot = _fake_hub_snapshot(source, hub, "tiny-org/qwen3-tiny", "b" * 40)
    (hub / "models--tiny-org--qwen3-tiny" / "refs" / "main").write_text("b" * 40)
    assert (snapshot / "model.safetensors").is_symlink()

    assert resolve_model_dir("tiny-org/qwen3-tiny") == str(snapshot)
    assert serve_cli.resolve_model("tiny-org/qwen3-tiny") == str(snapshot)
    args = serve_cli.build_parser().parse_args(["--model", "tiny-org/qwen3-tiny"])
    serve_cli.check_checkpoint(serve_cli.engine_config_from_args(args, str(snapshot)))
    assert safetensors_files(snapshot) == [snapshot / "model.safetensors"]
    assert load_tokenizer(str(snapshot)).encode("a b c") == [1, 2, 3]

    # The engine's model, loaded from the snapshot's symlinks, equals the one from the source.
    hf_config = AutoConfig.from_pretrained(str(snapshot))
    _, model_cls = resolve_architecture(hf_config)
    spec = model_cls.arch_spec(hf_config)
    loaded = []
    for directory in (snapshot, qwen3_ckpt):
        model = model_cls(spec, torch.float32, max_position=64)
        load_model(model, directory, torch.float32)
        loaded.append(model.state_dict())
    assert loaded[0].keys() == loaded[1].keys()
    for name, tensor in loaded[0].items():
        torch.testing.assert_close(tensor, loaded[1][name], rtol=0, atol=0, msg=name)
    from moe_engine import LLM, SamplingParams

    llm = LLM("tiny-org/qwen3-tiny", max_model_len=64, num_blocks_override=16)  # offline API
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_hub_cache_without_refs_main(hub_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No refs/main (a download of another revision): the only snapshot; several: refused,
    listing them."""
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_env / "hub"))
    source = hub_env / "source"
    source.mkdir()
    (source / "config.json").write_text("{}")
    repo = hub_env / "hub" / "models--org--name"
    only = _fake_hub_snapshot(source, hub_env / "hub", "org/name", "c" * 40)
    (repo / "refs" / "main").unlink()
    assert resolve_model_dir("org/name") == str(only)
    _fake_hub_snapshot(source, hub_env / "hub", "org/name", "d" * 40)
    (repo / "refs" / "main").unlink()
    with pytest.raises(FileNotFoundError, match="2 snapshots .* no refs/main"):
        resolve_model_dir("org/name")


# --- weights ----------------------------------------------------------------------------------


def test_folder_without_weights_lists_what_was_looked_for(
    qwen3_ckpt: Path, tmp_path: Path, capsys
) -> None:
    model = tmp_path / "no-weights"
    model.mkdir()
    (model / "config.json").write_text((qwen3_ckpt / "config.json").read_text())
    with pytest.raises(StartupError) as err:
        safetensors_files(model)
    message = str(err.value)
    assert "no weights found" in message and str(model) in message
    assert "model.safetensors.index.json" in message and "*.safetensors" in message
    assert "pickle" not in message  # no pickle file is there: nothing to warn about
    code, lines = _serve(capsys, "--model", str(model))
    assert code == 1 and len(lines) == 1 and "no weights found" in lines[0], lines


def test_index_naming_a_missing_shard(qwen3_sharded_ckpt: Path, tmp_path: Path) -> None:
    model = tmp_path / "partial"
    model.mkdir()
    for path in qwen3_sharded_ckpt.iterdir():
        (model / path.name).write_bytes(path.read_bytes())
    shards = sorted(model.glob("*.safetensors"))
    shards[-1].unlink()
    with pytest.raises(StartupError, match=f"not there.*{shards[-1].name}"):
        safetensors_files(model)


# --- int4 group size ----------------------------------------------------------------------------


def test_int4_group_size_that_does_not_divide_is_refused_before_weights_load(
    qwen3_ckpt: Path, tmp_path: Path, capsys
) -> None:
    """The tiny Qwen3 has hidden_size 64 and moe_intermediate_size 32: group 64 divides the
    first but not the second; the refusal comes from config.json alone (no weights there)."""
    model = tmp_path / "config-only"
    model.mkdir()
    (model / "config.json").write_text((qwen3_ckpt / "config.json").read_text())
    hf_config = read_config_json(model)
    with pytest.raises(ValueError) as err:
        resolve_quant_config(QuantConfig("int4", group_size=64), hf_config)
    message = str(err.value)
    assert "--quant-group-size 64" in message and "moe_intermediate_size=32" in message
    assert "--quant-group-size 32" in message  # the value that fits
    with pytest.raises(ValueError, match="hidden_size=64"):
        resolve_quant_config(QuantConfig("int4", group_size=128), hf_config)
    assert resolve_quant_config(QuantConfig("int4", group_size=32), hf_config).method == "int4"
    # moe-serve refuses it before looking for weights: this folder has none.
    code, lines = _serve(
        capsys, "--model", str(model), "--quantization", "int4", "--quant-group-size", "64"
    )
    assert code == 1 and len(lines) == 1, lines
    assert "--quant-group-size 64" in lines[0] and "moe_intermediate_size=32" in lines[0]


def test_mixtral_width_is_named_intermediate_size(mixtral_ckpt: Path) -> None:
    hf_config = read_config_json(mixtral_ckpt)  # hidden_size 64, intermediate_size 32
    with pytest.raises(ValueError, match=r"experts' intermediate_size=32 \(config.json\)"):
        resolve_quant_config(QuantConfig("int4", group_size=64), hf_config)


# --- prompts and tokenizers ---------------------------------------------------------------------


@pytest.mark.parametrize("length", [64, 65, 300])
def test_too_long_prompt_names_max_prompt_tokens(length: int) -> None:
    with pytest.raises(RequestError) as err:
        validate_request([1] * length, SamplingParams(), vocab_size=512, max_model_len=64)
    assert err.value.code == ErrorCode.OUT_OF_RANGE and err.value.field == "prompt"
    assert "--max-prompt-tokens" in err.value.message and "at most 63" in err.value.message


class _Records(logging.Handler):
    """Keeps the messages of every record it sees."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_tokenizer_length_warning_does_not_leak(tmp_path: Path) -> None:
    """A prompt longer than tokenizer_config.json's model_max_length encodes without
    transformers' "Token indices sequence length is longer" warning (the engine has its own
    limits), with the one load_tokenizer both the front end and the engine core use.
    transformers' loggers do not propagate to the root: the handler goes on theirs."""
    from transformers import AutoTokenizer

    from moe_engine.core import build as engine_core
    from moe_engine.core.tokenizer import load_tokenizer
    from moe_engine.engine import client as engine_client

    assert engine_client.load_tokenizer is load_tokenizer
    assert engine_core.load_tokenizer is load_tokenizer

    _write_tiny_tokenizer(tmp_path, model_max_length=4)
    records = _Records()
    hf_logger = logging.getLogger("transformers")
    hf_logger.addHandler(records)
    try:
        AutoTokenizer.from_pretrained(str(tmp_path)).encode("a b c " * 10)
        assert any("Token indices sequence length" in m for m in records.messages)  # it would
        records.messages.clear()
        tokenizer = load_tokenizer(str(tmp_path))
        assert tokenizer.encode("a b c " * 10) == [1, 2, 3] * 10
    finally:
        hf_logger.removeHandler(records)
    assert not [m for m in records.messages if "Token indices sequence length" in m]


# --- the port ---------------------------------------------------------------------------------


def test_port_in_use_is_one_line_without_grpc_log(qwen3_ckpt: Path) -> None:
    """moe-serve on a port another process listens on: exit status 1 and one line on stderr
    (gRPC's C++ "add_port.cc ... Failed to add port" log never appears)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        done = subprocess.run(
            [sys.executable, "-m", "moe_engine.cli.serve", "--model", str(qwen3_ckpt),
             "--grpc-port", str(port), "--port", "0"],
            capture_output=True, text=True, env=env, timeout=120,
        )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0] and "--grpc-port" in lines[0]


def test_check_bindable_allows_a_free_port_and_port_zero() -> None:
    from moe_engine.server.options import check_bindable

    check_bindable("127.0.0.1", 0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    check_bindable("127.0.0.1", port)  # closed again: free
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        with pytest.raises(StartupError, match="in use"):
            check_bindable("127.0.0.1", port)


# --- versions -----------------------------------------------------------------------------------


def test_versions_come_from_pyproject(capsys) -> None:
    from moe_engine.cli import client as client_cli

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert moe_engine.__version__ == version
    for main, prog in ((serve_cli.main, "moe-serve"), (client_cli.main, "moe-client")):
        with pytest.raises(SystemExit) as info:
            main(["--version"])
        assert info.value.code == 0
        assert capsys.readouterr().out.strip() == f"{prog} {version}"


def test_an_engine_startup_failure_is_one_error_line(qwen3_ckpt: Path, tmp_path: Path) -> None:
    """A failure the engine core finds after the port opened (here a tensor missing from the
    weights): exit status 1, and the log's last line is the reason; no "stopped by signal"
    line from the core that the front end then ends."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(qwen3_ckpt, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "moe_engine.cli.serve", "--model", str(broken), "--port", "0",
         "--grpc-port", str(_free_port())],
        capture_output=True, text=True, env=env, timeout=120,
    )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, done.stderr
    assert lines[-1].startswith("moe-serve: error: engine core failed to start: ")
    assert "'model.layers.1.self_attn.k_proj.weight'" in lines[-1]
    assert not any("stopped by signal" in line for line in lines), done.stderr
