"""RL weight sync through the served engine (issue 20), at --ep-size 1 and 2: the test process
is the trainer (`moe_engine.rl.WeightSync`: a gloo group with every engine rank, bucketed
broadcasts), and `UpdateWeights` from disk. After an update greedy ids equal transformers on
the new weights and every response carries the new version; under expert parallelism each
rank keeps only its experts' slices; a refused push leaves outputs unchanged and the group
usable; KV blocks return to their start value.
"""

from __future__ import annotations

import grpc
import pytest
from fixtures import hf_greedy, perturbed_checkpoint
from grpc_helpers import ServerThread, greedy_streams, stats, wait_idle
from safetensors.torch import load_file

from moe_engine.rl import WeightSync, WeightSyncError
from moe_engine.server.app import ServerOptions
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.startup.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
)

PROMPTS = [[5, 6, 7, 8], [100, 3, 9, 40, 41], list(range(20, 47))]
MAX_NEW = [8, 6, 7]


@pytest.fixture(scope="module", params=[1, pytest.param(2, id="ep2")])
def served(request, qwen3_ckpt):
    config = EngineConfig(
        model=ModelConfig(model=str(qwen3_ckpt), max_model_len=128),
        cache=CacheConfig(num_blocks_override=64),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=48),
        parallel=ParallelConfig(ep_size=request.param, collective_timeout_s=60),
    )
    handle = ServerThread(config, ServerOptions(port=0), startup_timeout_s=300)
    channel = grpc.insecure_channel(handle.address)
    try:
        stub = pb_grpc.MoeEngineStub(channel)
        yield handle, stub, stats(stub).kv_blocks_free
    finally:
        channel.close()
        handle.close()


@pytest.fixture(scope="module")
def new_ckpt(qwen3_ckpt, tmp_path_factory):
    return perturbed_checkpoint(qwen3_ckpt, tmp_path_factory.mktemp("wu_ep"))


def _state(path) -> dict:
    return dict(sorted(load_file(str(path / "model.safetensors")).items()))


def _versions(stub) -> set[str]:
    req = pb.GenerateRequest(max_tokens=2, temperature=0.0, ignore_eos=True)
    req.prompt_ids.ids.extend([9, 8, 7])
    return {r.weight_version for r in stub.Generate(req, timeout=60)}


def test_a_trainer_pushes_weights_in_three_calls(served, qwen3_ckpt, new_ckpt) -> None:
    handle, stub, free = served
    assert greedy_streams(stub, PROMPTS, MAX_NEW) == [
        hf_greedy(qwen3_ckpt, [p], n)[0] for p, n in zip(PROMPTS, MAX_NEW, strict=True)
    ]
    sync = WeightSync(handle.address, bucket_bytes=96 * 1024, timeout_s=60)
    try:
        assert sync.world_size == 1 + stub.GetModelInfo(pb.GetModelInfoRequest()).ep_size
        reply = sync.push(_state(new_ckpt), "step-1")
        assert reply.weight_version == "step-1" and reply.num_tensors == len(_state(new_ckpt))
        expected = [hf_greedy(new_ckpt, [p], n)[0] for p, n in zip(PROMPTS, MAX_NEW,
                                                                     strict=True)]
        assert greedy_streams(stub, PROMPTS, MAX_NEW) == expected
        assert _versions(stub) == {"step-1"}
        assert stub.GetModelInfo(pb.GetModelInfoRequest()).weight_version == "step-1"
        # a refused push (one wrong shape): nothing is sent, outputs unchanged, group usable
        bad = _state(qwen3_ckpt)
        name = "model.layers.0.self_attn.o_proj.weight"
        bad[name] = bad[name][:, :-2].contiguous()
        with pytest.raises(WeightSyncError) as info:
            sync.push(bad, "never")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert name in str(info.value) and "shape" in str(info.value)
        assert greedy_streams(stub, PROMPTS, MAX_NEW) == expected
        sync.push(_state(qwen3_ckpt), "step-2")  # the same group again
        assert greedy_streams(stub, PROMPTS, MAX_NEW) == [
            hf_greedy(qwen3_ckpt, [p], n)[0] for p, n in zip(PROMPTS, MAX_NEW, strict=True)
        ]
    finally:
        sync.close()
    wait_idle(stub, free)


def test_from_disk_at_every_rank(served, qwen3_ckpt, new_ckpt) -> None:
    handle, stub, free = served
    reply = stub.UpdateWeights(pb.UpdateWeightsRequest(
        weight_version="disk-1", from_disk=pb.UpdateWeightsFromDisk(path=str(new_ckpt)),
    ), timeout=300)
    assert reply.weight_version == "disk-1" and reply.num_bytes > 0
    assert greedy_streams(stub, PROMPTS, MAX_NEW) == [
        hf_greedy(new_ckpt, [p], n)[0] for p, n in zip(PROMPTS, MAX_NEW, strict=True)
    ]
    stub.UpdateWeights(pb.UpdateWeightsRequest(
        weight_version="disk-2", from_disk=pb.UpdateWeightsFromDisk(path=str(qwen3_ckpt)),
    ), timeout=300)
    assert _versions(stub) == {"disk-2"}
    wait_idle(stub, free)


def test_a_trainer_that_restarts_without_closing_joins_again(served, qwen3_ckpt, new_ckpt
                                                            ) -> None:
    """A trainer that died between init and close left its group on the engine: a new
    WeightSync of the same group name replaces it (no ALREADY_EXISTS), and a push the client
    refuses itself (empty version, no tensor) sends nothing and leaves its group usable."""
    handle, stub, free = served
    crashed = WeightSync(handle.address, timeout_s=30)
    crashed.group.close()  # as if the process died: no DestroyWeightUpdateGroup
    crashed.group = None
    sync = WeightSync(handle.address, timeout_s=30)
    try:
        with pytest.raises(ValueError, match="weight_version"):
            sync.push(_state(new_ckpt), "")
        with pytest.raises(ValueError, match="no tensor"):
            sync.push({}, "v")
        sync.push(_state(new_ckpt), "again")
        assert _versions(stub) == {"again"}
        sync.push(_state(qwen3_ckpt), "back")
    finally:
        sync.close()
        sync.close()  # twice is fine
    assert greedy_streams(stub, PROMPTS, MAX_NEW) == [
        hf_greedy(qwen3_ckpt, [p], n)[0] for p, n in zip(PROMPTS, MAX_NEW, strict=True)
    ]
    wait_idle(stub, free)
