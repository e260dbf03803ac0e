"""RL weight updates through the server (issue 20): the gRPC rollout RPCs (PauseGeneration,
ResumeGeneration, UpdateWeights, the weight-update group RPCs), the `moe-client` subcommands and
SGLang's HTTP admin endpoints, against one real server (the tiny float32 Qwen3-MoE, an API key).

The oracle: after an update to a perturbed checkpoint (`fixtures.perturbed_checkpoint`: every
parameter + 0.05 * randn), greedy ids equal transformers on that checkpoint; a refused update
leaves greedy ids bit-identical; a retracted request continues with exactly what transformers
gives on the new weights for its prefix so far. Every test leaves the server as it found it:
not paused, weight version "default" on the original weights, every KV block free.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from fixtures import hf_greedy, perturbed_checkpoint
from grpc_helpers import ServerThread, free_port, request, token_ids, wait_idle
from safetensors.torch import load_file, save_file

from moe_engine.cli import client as cli
from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig

API_KEY = "rl-key"
AUTH = (("authorization", f"Bearer {API_KEY}"),)
NUM_BLOCKS = 64
MAX_MODEL_LEN = 256
PROMPTS = [[5, 6, 7, 8], [100, 3, 9]]
N = 8
Q = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weight_update_grpc")


@pytest.fixture(scope="module")
def new_ckpt(qwen3_ckpt: Path, root: Path) -> Path:
    return perturbed_checkpoint(qwen3_ckpt, root)


def _config(ckpt: Path) -> EngineConfig:
    return EngineConfig(
        model=ModelConfig(str(ckpt), max_model_len=MAX_MODEL_LEN),
        cache=CacheConfig(block_size=16, num_blocks_override=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
    )


@pytest.fixture(scope="module")
def server(qwen3_ckpt: Path) -> Iterator[ServerThread]:
    config = _config(qwen3_ckpt)
    options = ServerOptions(port=0, http_port=0, api_key=API_KEY, log_stats_interval_s=None)
    handle = ServerThread(config, options)
    yield handle
    handle.close()


@pytest.fixture(scope="module")
def stub(server: ServerThread) -> Iterator[pb_grpc.MoeEngineStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.MoeEngineStub(channel)


def _info(stub) -> pb.ModelInfo:
    return stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=AUTH)


def _update(stub, path: Path | str, version: str, **kw) -> pb.WeightControlResponse:
    req = pb.UpdateWeightsRequest(weight_version=version,
                                  from_disk=pb.UpdateWeightsFromDisk(path=str(path)), **kw)
    return stub.UpdateWeights(req, metadata=AUTH, timeout=120)


def _pause(stub, mode: str = "") -> pb.WeightControlResponse:
    return stub.PauseGeneration(pb.PauseGenerationRequest(mode=mode), metadata=AUTH, timeout=30)


def _resume(stub) -> pb.WeightControlResponse:
    return stub.ResumeGeneration(pb.ResumeGenerationRequest(), metadata=AUTH, timeout=30)


def _greedy_req(prompt: list[int], n: int, **kw) -> pb.GenerateRequest:
    return request(prompt, max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _generate(stub, prompts=PROMPTS, n: int = N) -> list[list[pb.GenerateResponse]]:
    return [list(stub.Generate(_greedy_req(p, n), metadata=AUTH, timeout=60)) for p in prompts]


def _greedy(stub, prompts=PROMPTS, n: int = N) -> list[list[int]]:
    return [token_ids(r) for r in _generate(stub, prompts, n)]


def _stats(stub) -> pb.ServerStats:
    return stub.GetServerStats(pb.GetServerStatsRequest(), metadata=AUTH)


class _AuthStub:
    """`grpc_helpers.wait_idle` calls `stub.GetServerStats(request)`: with the key here."""

    def __init__(self, stub) -> None:
        self.stub = stub

    def GetServerStats(self, req):  # noqa: N802 - the stub's name
        return self.stub.GetServerStats(req, metadata=AUTH)


class Stream:
    """One Generate call read on a thread: its responses as they arrive."""

    def __init__(self, stub, req: pb.GenerateRequest) -> None:
        self.responses: list[pb.GenerateResponse] = []
        self.error: grpc.RpcError | None = None
        self.arrived: queue.Queue = queue.Queue()
        self.call = stub.Generate(req, metadata=AUTH, timeout=120)
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for r in self.call:
                self.responses.append(r)
                self.arrived.put(r)
        except grpc.RpcError as err:
            self.error = err
        self.arrived.put(None)

    @property
    def tokens(self) -> list[int]:
        return token_ids(list(self.responses))

    def wait_tokens(self, n: int, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.tokens) < n and self.thread.is_alive():
            assert time.monotonic() < deadline, f"{len(self.tokens)} tokens after {timeout_s} s"
            time.sleep(0.002)

    def settle(self, quiet_s: float = 0.3) -> int:
        """Wait until nothing arrived for `quiet_s`; the number of responses then."""
        while True:
            try:
                self.arrived.get(timeout=quiet_s)
            except queue.Empty:
                return len(self.responses)

    def join(self, timeout_s: float = 60) -> list[pb.GenerateResponse]:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), "the stream did not end"
        if self.error is not None:
            raise self.error
        return self.responses


@pytest.fixture(autouse=True)
def clean(server, stub, qwen3_ckpt) -> Iterator[None]:
    """After each test: resumed, the original weights as "default", every KV block free."""
    yield
    _resume(stub)
    if _info(stub).weight_version != "default":
        _update(stub, qwen3_ckpt, "default")
    wait_idle(_AuthStub(stub), NUM_BLOCKS)


def _bad_folder(root: Path, name: str, tensors: dict) -> Path:
    path = root / name
    path.mkdir(exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    return path


# ---------------------------------------------------------------------- updates


def test_update_from_disk_serves_the_new_weights(stub, qwen3_ckpt, new_ckpt) -> None:
    assert _info(stub).weight_version == "default"
    before = _generate(stub)
    assert [token_ids(r) for r in before] == hf_greedy(qwen3_ckpt, PROMPTS, N)
    assert {r.weight_version for rs in before for r in rs} == {"default"}
    reply = _update(stub, new_ckpt, "step-1")
    assert (reply.weight_version, reply.paused) == ("step-1", False)
    assert reply.num_tensors == len(load_file(str(new_ckpt / "model.safetensors")))
    assert reply.num_bytes > 0 and reply.seconds > 0
    assert _info(stub).weight_version == "step-1"
    after = _generate(stub)
    assert [token_ids(r) for r in after] == hf_greedy(new_ckpt, PROMPTS, N)
    assert {r.weight_version for rs in after for r in rs} == {"step-1"}


def _bad_update(case: str, root: Path, new_ckpt: Path) -> tuple[pb.UpdateWeightsRequest, str]:
    """A refused update and the field (moe-field) it names."""
    good = load_file(str(new_ckpt / "model.safetensors"))
    if case == "shape":  # every other tensor is fine: none may land
        path, field = _bad_folder(root, "bad-shape", {**good, Q: good[Q][:-1].clone()}), Q
    elif case == "name":
        bad = "model.layers.0.self_attn.not_a_weight"
        path, field = _bad_folder(root, "bad-name", {**good, bad: good[Q].clone()}), bad
    elif case == "path":
        path, field = root / "missing", "path"
    elif case == "version":
        path, field = new_ckpt, "weight_version"
    else:  # no source
        return pb.UpdateWeightsRequest(weight_version="bad"), "source"
    version = "" if case == "version" else "bad"
    return pb.UpdateWeightsRequest(
        weight_version=version, from_disk=pb.UpdateWeightsFromDisk(path=str(path))
    ), field


@pytest.mark.parametrize("case", ["shape", "name", "path", "version", "source"])
def test_a_bad_update_is_refused_and_changes_nothing(stub, root, new_ckpt, case) -> None:
    before = _greedy(stub)
    req, field = _bad_update(case, root, new_ckpt)
    with pytest.raises(grpc.RpcError) as info:
        stub.UpdateWeights(req, metadata=AUTH, timeout=60)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert field in err.details(), err.details()
    assert dict(err.trailing_metadata())["moe-field"] == field
    if case in ("shape", "name", "path"):  # refused by the core
        assert "nothing changed" in err.details(), err.details()
    assert _info(stub).weight_version == "default"
    assert _greedy(stub) == before


@pytest.mark.parametrize(
    ("call", "message", "field"),
    [
        ("PauseGeneration", pb.PauseGenerationRequest(mode="later"), "mode"),
        ("InitWeightUpdateGroup", pb.InitWeightUpdateGroupRequest(
            master_address="127.0.0.1", master_port=29999, rank_offset=1, world_size=1),
         "world_size"),
        ("InitWeightUpdateGroup", pb.InitWeightUpdateGroupRequest(
            master_address="127.0.0.1", master_port=29999, rank_offset=0, world_size=2),
         "rank_offset"),
        ("InitWeightUpdateGroup", pb.InitWeightUpdateGroupRequest(
            master_address="127.0.0.1", master_port=29999, rank_offset=2, world_size=2),
         "rank_offset"),
        ("InitWeightUpdateGroup", pb.InitWeightUpdateGroupRequest(
            master_address="127.0.0.1", master_port=0, rank_offset=1, world_size=2),
         "master_port"),
        ("InitWeightUpdateGroup", pb.InitWeightUpdateGroupRequest(
            master_address="127.0.0.1", master_port=70000, rank_offset=1, world_size=2),
         "master_port"),
        ("InitWeightUpdateGroup", pb.InitWeightUpdateGroupRequest(
            master_address="127.0.0.1", master_port=29999, rank_offset=1, world_size=2,
            backend="mpi"), "backend"),
        ("UpdateWeights", pb.UpdateWeightsRequest(
            weight_version="v", from_distributed=pb.UpdateWeightsFromDistributed()), "tensors"),
    ],
)
def test_front_end_refusals_name_the_field(stub, call, message, field) -> None:
    with pytest.raises(grpc.RpcError) as info:
        getattr(stub, call)(message, metadata=AUTH, timeout=10)
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(f"{field}:"), err.details()
    assert dict(err.trailing_metadata())["moe-field"] == field


def test_weight_update_groups(stub) -> None:
    """Leaving a group never joined is a no-op; an update over it is refused; a join whose
    trainer never comes is UNAVAILABLE after its timeout."""
    left = stub.DestroyWeightUpdateGroup(pb.DestroyWeightUpdateGroupRequest(), metadata=AUTH)
    assert (left.weight_version, left.paused) == ("default", False)
    tensor = pb.TensorMeta(name=Q, dtype="float32", shape=[64, 64])
    with pytest.raises(grpc.RpcError) as info:
        stub.UpdateWeights(pb.UpdateWeightsRequest(
            weight_version="v", from_distributed=pb.UpdateWeightsFromDistributed(
                tensors=[tensor])), metadata=AUTH, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "InitWeightUpdateGroup first" in info.value.details()
    assert dict(info.value.trailing_metadata())["moe-field"] == "group_name"
    with pytest.raises(grpc.RpcError) as info:
        stub.InitWeightUpdateGroup(pb.InitWeightUpdateGroupRequest(
            master_address="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2,
            timeout_s=1.0), metadata=AUTH, timeout=60)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value.details()
    assert dict(info.value.trailing_metadata())["moe-field"] == "group"


def test_the_rollout_rpcs_need_the_api_key(stub) -> None:
    calls = [
        (stub.PauseGeneration, pb.PauseGenerationRequest()),
        (stub.ResumeGeneration, pb.ResumeGenerationRequest()),
        (stub.UpdateWeights, pb.UpdateWeightsRequest(weight_version="x")),
        (stub.InitWeightUpdateGroup, pb.InitWeightUpdateGroupRequest()),
        (stub.DestroyWeightUpdateGroup, pb.DestroyWeightUpdateGroupRequest()),
    ]
    for call, message in calls:
        with pytest.raises(grpc.RpcError) as info:
            call(message, timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _resume(stub).paused is False


# ---------------------------------------------------------------------- pause and resume


def test_pause_abort_ends_the_requests_in_flight(stub) -> None:
    stream = Stream(stub, _greedy_req([11, 12, 13], 200))
    stream.wait_tokens(2)
    reply = _pause(stub, "abort")
    assert (reply.paused, reply.num_aborted) == (True, 1)
    responses = stream.join()
    assert responses[-1].finished and responses[-1].finish_reason == "abort"
    assert len(stream.tokens) < 200
    assert _resume(stub).paused is False


def test_pause_keep_holds_requests_until_resume(stub) -> None:
    prompt, later_prompt, n = [21, 22, 23], [40, 41], 100
    want, want_later = _greedy(stub, [prompt, later_prompt], n)
    stream = Stream(stub, _greedy_req(prompt, n))
    stream.wait_tokens(2)
    reply = _pause(stub)  # mode unset: keep
    assert (reply.paused, reply.num_kept, reply.num_aborted) == (True, 1, 0)
    got = stream.settle()
    later = Stream(stub, _greedy_req(later_prompt, n))  # sent while paused: it waits
    time.sleep(1.0)
    assert len(stream.responses) == got and not later.responses
    assert not stream.responses[-1].finished
    s = _stats(stub)
    assert (s.num_running, s.num_waiting, s.paused) == (1, 1, True), s
    assert s.weight_version == "default"
    assert _resume(stub).paused is False
    assert _stats(stub).paused is False
    responses, later_responses = stream.join(), later.join()
    assert responses[-1].finish_reason == "length" and stream.tokens == want
    assert later_responses[-1].finish_reason == "length" and later.tokens == want_later


def test_pause_retract_recomputes_on_the_new_weights(stub, new_ckpt) -> None:
    prompt, n = [31, 32, 33, 34], 64
    stream = Stream(stub, _greedy_req(prompt, n))
    stream.wait_tokens(3)
    reply = _pause(stub, "retract")
    assert (reply.paused, reply.num_retracted) == (True, 1)
    stream.settle()
    so_far = stream.tokens
    assert 3 <= len(so_far) < n
    update = _update(stub, new_ckpt, "step-2")
    assert (update.weight_version, update.paused) == ("step-2", True)
    _resume(stub)
    responses = stream.join()
    assert responses[-1].finish_reason == "length"
    rest = hf_greedy(new_ckpt, [prompt + so_far], n - len(so_far))[0]
    assert stream.tokens == so_far + rest
    old = [r for r in responses if r.weight_version == "default"]
    assert token_ids(old) == so_far  # the responses before the pause: the old weights
    assert {r.weight_version for r in responses[len(old):]} == {"step-2"}


# ---------------------------------------------------------------------- moe-client, HTTP


def test_cli_pause_resume_update_weights(server, new_ckpt, root, capsys) -> None:
    def run(*argv: str) -> tuple[int, str, str]:
        code = cli.main(["--server", address, "--api-key", API_KEY, "--timeout", "60", *argv])
        out, err = capsys.readouterr()
        return code, out, err

    address = server.address
    code, out, _ = run("pause", "--mode", "keep")
    assert code == 0 and out.startswith("paused (mode keep): weight_version=default paused=true")
    assert "num_kept=0" in out and out.count("\n") == 1
    code, out, _ = run("resume")
    assert (code, out) == (0, "resumed: weight_version=default paused=false\n")
    code, out, _ = run("update-weights", "--from-disk", str(new_ckpt), "--weight-version",
                       "cli-1")
    assert code == 0 and out.startswith("weights updated: weight_version=cli-1 paused=false "
                                        "num_tensors="), out
    code, out, _ = run("info")
    assert code == 0 and any(line.split() == ["weight_version", "cli-1"]
                             for line in out.splitlines()), out
    code, out, err = run("update-weights", "--from-disk", str(root / "missing"),
                         "--weight-version", "cli-2")
    assert code == 1 and out == "" and err.startswith("error: INVALID_ARGUMENT: path:"), err
    assert "nothing changed, weight version cli-1 keeps serving" in err
    code, _, err = run("update-weights", "--from-disk", str(new_ckpt), "--weight-version", "")
    assert code == 2 and "--weight-version" in err


def test_http_admin_endpoints(server, stub, new_ckpt, root) -> None:
    base = f"http://127.0.0.1:{server.server.http_port}"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.post(f"{base}/pause_generation", json={"mode": "keep"}).status_code == 401
    paused = httpx.post(f"{base}/pause_generation", json={"mode": "in_place"}, headers=auth)
    assert paused.status_code == 200, paused.text
    body = paused.json()
    assert body["success"] is True and body["paused"] is True
    assert body["weight_version"] == "default"
    resumed = httpx.post(f"{base}/continue_generation", headers=auth).json()
    assert resumed["success"] is True and resumed["paused"] is False
    bad = httpx.post(f"{base}/pause_generation", json={"mode": "later"}, headers=auth)
    assert bad.status_code == 400 and bad.json()["field"] == "mode"
    missing = httpx.post(f"{base}/update_weights_from_disk", headers=auth, timeout=60,
                         json={"model_path": str(root / "missing"), "weight_version": "h"})
    assert missing.status_code == 400
    assert missing.json()["success"] is False and missing.json()["field"] == "model_path"
    assert missing.json()["message"].startswith("model_path:")
    done = httpx.post(f"{base}/update_weights_from_disk", headers=auth, timeout=60,
                      json={"model_path": str(new_ckpt), "weight_version": "http-1"})
    assert done.status_code == 200, done.text
    assert done.json()["success"] is True and done.json()["weight_version"] == "http-1"
    assert _info(stub).weight_version == "http-1"
    assert _greedy(stub) == hf_greedy(new_ckpt, PROMPTS, N)
    # the OpenAI API's choices say which weights computed them (an extension field)
    completion = httpx.post(f"{base}/v1/completions", headers=auth, timeout=60, json={
        "model": server.server.http_state.served_model_name, "prompt": PROMPTS[0],
        "max_tokens": 3, "temperature": 0})
    assert completion.status_code == 200, completion.text
    assert completion.json()["choices"][0]["weight_version"] == "http-1"


def test_a_paused_server_drains_by_resuming(qwen3_ckpt) -> None:
    """Stopping a paused server resumes generation for the drain: the request in flight
    finishes ("length", all its tokens) within the grace time instead of being aborted."""
    handle = ServerThread(_config(qwen3_ckpt), ServerOptions(port=0, log_stats_interval_s=None))
    try:
        with grpc.insecure_channel(handle.address) as channel:
            own = pb_grpc.MoeEngineStub(channel)
            stream = Stream(own, _greedy_req([7, 8, 9], 60))
            stream.wait_tokens(2)
            own.PauseGeneration(pb.PauseGenerationRequest(mode="keep"), timeout=30)
            stream.settle()
            assert not stream.responses[-1].finished
            handle.run(handle.server.stop(grace_s=20.0), timeout=60)
            responses = stream.join()
    finally:
        handle.close()
    assert responses[-1].finish_reason == "length" and len(stream.tokens) == 60
