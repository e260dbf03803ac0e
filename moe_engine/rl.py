"""Trainer-side weight sync for RL: push a `state_dict` into a serving engine in three calls.

    from moe_engine.rl import WeightSync

    sync = WeightSync("localhost:50051")          # once: creates the group, the engine joins
    for step in range(num_steps):
        ...                                        # rollouts through the engine, a train step
        sync.push(model.state_dict(), f"step-{step}")  # the engine serves the new weights
    sync.close()

The trainer is rank 0 of a separate torch.distributed group (`weight_update.group.WeightGroup`:
a TCPStore the trainer hosts, gloo on CPU or NCCL on GPU; the engine's ranks join it through
the `InitWeightUpdateGroup` RPC, an expert-parallel engine with every rank). `push` names every
tensor (checkpoint name, dtype, shape) in an `UpdateWeights` RPC, waits for every engine rank
to accept the list (a one-flag all-reduce: a refused update sends nothing), then broadcasts the
tensors packed in buckets (`weight_update.buckets`), the same protocol as SGLang's
`update_weights_from_distributed` and verl's bucketed sync. The engine swaps the weights in only
when every bucket arrived; if the trainer dies mid-transfer the engine keeps the old weights.
Names are the checkpoint's (a transformers model's `state_dict()` keys are).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import torch

from moe_engine.engine.launcher import free_port
from moe_engine.server.pb import moe_engine_pb2 as pb
from moe_engine.server.pb import moe_engine_pb2_grpc as pb_grpc
from moe_engine.server.security import auth_metadata
from moe_engine.weight_update.buckets import default_bucket_bytes
from moe_engine.weight_update.group import WeightGroup
from moe_engine.weight_update.messages import (
    DEFAULT_BACKEND,
    DEFAULT_GROUP_NAME,
    DEFAULT_GROUP_TIMEOUT_S,
    TensorMeta,
    weight_version_problem,
)
from moe_engine.weight_update.targets import meta_of

#: How long an UpdateWeights or InitWeightUpdateGroup RPC may take beyond the group timeout (s).
RPC_SLACK_S = 60.0


class WeightSyncError(RuntimeError):
    """The engine refused or failed an update (its status `code` and message); the engine
    keeps serving its previous weights."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


class WeightSync:
    """Rank 0 of a weight-update group with one engine (all its ranks).

    Args:
        engine: the engine's gRPC address ("host:port").
        master_address: the address the engine's ranks reach this process at (the TCPStore
            host); master_port: its port (None: a free one).
        backend: "gloo" (CPU tensors) or "nccl" (CUDA tensors).
        group_name: names the group on the engine (several trainers may use several).
        bucket_bytes: bytes per broadcast (None: 32 MiB over gloo, 256 MiB over NCCL).
        timeout_s: joining and every collective (seconds).
        api_key: the engine's --api-key, if it has one.
        device: where buckets are packed (default: the CPU for gloo, the current CUDA device
            for NCCL).

    Raises:
        WeightSyncError: the engine refused to join (or did not answer).
        RuntimeError: the group could not be formed within timeout_s.
    """

    def __init__(
        self,
        engine: str,
        *,
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        backend: str = DEFAULT_BACKEND,
        group_name: str = DEFAULT_GROUP_NAME,
        bucket_bytes: int | None = None,
        timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
        api_key: str | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.group_name, self.timeout_s = group_name, timeout_s
        self.bucket_bytes = bucket_bytes or default_bucket_bytes(backend)
        self.device = device or torch.device("cpu" if backend == "gloo" else "cuda")
        self._channel = grpc.insecure_channel(engine)
        self._stub = pb_grpc.MoeEngineStub(self._channel)
        self._metadata = auth_metadata(api_key)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weight-sync")
        info = self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(), 30.0)
        self.world_size = 1 + max(1, info.ep_size)
        port = master_port or free_port(master_address)
        joined = self._pool.submit(self._call, self._stub.InitWeightUpdateGroup,
                                   pb.InitWeightUpdateGroupRequest(
                                       master_address=master_address, master_port=port,
                                       rank_offset=1, world_size=self.world_size,
                                       backend=backend, group_name=group_name,
                                       timeout_s=timeout_s,
                                   ), timeout_s + RPC_SLACK_S)
        forming = _Background(lambda: WeightGroup(
            master_address, port, 0, self.world_size, backend, group_name, timeout_s,
            self.device,
        ))
        while not forming.done.wait(0.01):
            if joined.done() and joined.exception() is not None:
                joined.result()  # the engine refused to join: raise why, do not wait it out
        self.group: WeightGroup | None = forming.result()
        joined.result()
        self._joined, self._closed = True, False

    def push(
        self,
        state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        weight_version: str,
        *,
        flush_cache: bool = True,
    ) -> pb.WeightControlResponse:
        """Send every tensor of `state_dict` (checkpoint names) and make the engine serve them
        as `weight_version`; returns the engine's answer (tensors, bytes, seconds).

        Raises:
            WeightSyncError: the engine refused the update (an unknown name, a wrong shape or
                dtype: nothing was sent) or failed it; it still serves its previous weights.
            RuntimeError: this side's group failed (the engine is gone mid-transfer).
        """
        if self._closed:
            raise RuntimeError("WeightSync is closed")
        if self.group is None:
            raise RuntimeError(
                "the weight-update group is unusable after an earlier failure of this "
                "WeightSync; close() it and make a new one (the engine then joins afresh)"
            )
        items = list(state_dict.items() if isinstance(state_dict, Mapping) else state_dict)
        _check_push(items, weight_version)
        tensors = [t.detach().to(self.device) for _, t in items]
        metas = [meta_of(name, t) for (name, _), t in zip(items, tensors, strict=True)]
        request = pb.UpdateWeightsRequest(
            weight_version=weight_version, flush_cache=flush_cache,
            from_distributed=pb.UpdateWeightsFromDistributed(
                tensors=[pb.TensorMeta(name=m.name, dtype=m.dtype, shape=m.shape) for m in metas],
                group_name=self.group_name, bucket_bytes=self.bucket_bytes,
            ),
        )
        answer = self._pool.submit(self._call, self._stub.UpdateWeights, request,
                                   self.timeout_s + RPC_SLACK_S)
        if not self._handshake(answer):
            answer.result()  # raises the engine's refusal
            raise WeightSyncError(grpc.StatusCode.INVALID_ARGUMENT, "the engine refused")
        try:
            self.group.send(metas, tensors, self.bucket_bytes)
        except Exception:
            self.group = None  # a peer is gone mid-transfer: the group cannot be used again
            raise
        return answer.result()

    def _handshake(self, answer: Future) -> bool:
        """Every engine rank's verdict on the tensor list (True: send). An RPC that ends
        before the engine reached the group (refused by the front end) leaves the group
        unusable: it is dropped and the refusal raised."""
        group = self.group
        verdict = _Background(lambda: group.agree(False))
        while not verdict.done.wait(0.01):
            if answer.done() and answer.exception() is not None:
                if verdict.done.wait(0.5):  # the engine may still be answering the handshake
                    break
                self.group = None  # its pending collective never completes
                answer.result()
        return verdict.result()

    def close(self) -> None:
        """Tell the engine to leave the group and drop ours (safe to call twice; an engine
        that is gone is not waited for)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        try:
            if self._joined:
                self._call(self._stub.DestroyWeightUpdateGroup,
                           pb.DestroyWeightUpdateGroupRequest(group_name=self.group_name), 30.0)
        except WeightSyncError:
            pass  # the engine is gone or stopping: it holds no group worth leaving
        finally:
            if self.group is not None:
                self.group.close()
                self.group = None
            self._pool.shutdown(wait=False)
            self._channel.close()

    def __enter__(self) -> WeightSync:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method, request, timeout_s: float):
        try:
            return method(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            raise WeightSyncError(exc.code(), exc.details()) from None


class _Background:
    """`fn()` on a daemon thread (one stuck in a collective must not hold up exit)."""

    def __init__(self, fn) -> None:
        self.done = threading.Event()
        self._value: list = []
        self._error: list[BaseException] = []
        threading.Thread(target=self._run, args=(fn,), daemon=True,
                         name="weight-sync").start()

    def _run(self, fn) -> None:
        try:
            self._value.append(fn())
        except BaseException as exc:  # noqa: BLE001 - re-raised by result()
            self._error.append(exc)
        finally:
            self.done.set()

    def result(self):
        self.done.wait()
        if self._error:
            raise self._error[0]
        return self._value[0]


def _check_push(items: list, weight_version: str) -> None:
    """Refuse, before anything is sent, what the engine would refuse before the handshake
    (which would leave the group unusable).

    Raises:
        ValueError: no tensor, or a weight_version the engine refuses
            (`control.weight_version_problem`).
    """
    if not items:
        raise ValueError("push: the state dict names no tensor")
    problem = weight_version_problem(weight_version)
    if problem is not None:
        raise ValueError(f"push: {problem}")


__all__ = ["TensorMeta", "WeightSync", "WeightSyncError"]
