"""`LLM`'s weight-update methods (RL rollouts offline): new weights from disk or from a
trainer's process group, between two `generate` calls, without a restart.

The same operations as the server's `UpdateWeights` / `InitWeightUpdateGroup` RPCs
(`moe_engine.weight_update.control`), run on the in-process engine core.
"""

from __future__ import annotations

from moe_engine.weight_update.messages import (
    DEFAULT_BACKEND,
    DEFAULT_GROUP_NAME,
    DEFAULT_GROUP_TIMEOUT_S,
    ControlReply,
    DestroyWeightUpdateGroup,
    InitWeightUpdateGroup,
    TensorMeta,
    UpdateWeights,
)


class WeightUpdateMethods:
    """Mixed into `LLM` (which sets `self.engine`, an `EngineCore`)."""

    engine: object

    @property
    def weight_version(self) -> str:
        """The version of the weights serving now (`--weight-version` / `weight_version=`
        at startup, then each update's)."""
        return self.engine.rollout.weight_version

    def update_weights_from_disk(
        self, path: str, weight_version: str, flush_cache: bool = True
    ) -> ControlReply:
        """Replace the weights found in checkpoint folder `path` (all tensors or some; same
        architecture and shapes), atomically.

        Returns:
            The reply: tensors and bytes taken, seconds.

        Raises:
            RequestError: INVALID_ARGUMENT for a refused update (an unknown name, a wrong
                shape or dtype, a folder of another architecture); nothing changed then.
        """
        return self._control(UpdateWeights(0, weight_version, "disk", path=path,
                                           flush_cache=flush_cache))

    def init_weight_update_group(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int,
        backend: str = DEFAULT_BACKEND, group_name: str = DEFAULT_GROUP_NAME,
        timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    ) -> ControlReply:
        """Join the trainer's weight-update group (`moe_engine.rl.WeightSync` makes it);
        blocks until every member joined.

        Raises:
            RequestError: UNAVAILABLE when the trainer's store or a member does not answer
                within timeout_s; INVALID_ARGUMENT for a bad backend or rank.
        """
        return self._control(InitWeightUpdateGroup(
            0, master_address, master_port, rank_offset, world_size, backend, group_name,
            timeout_s,
        ))

    def update_weights_from_distributed(
        self, tensors: list[TensorMeta], weight_version: str,
        group_name: str = DEFAULT_GROUP_NAME, bucket_bytes: int = 0, flush_cache: bool = True,
    ) -> ControlReply:
        """Receive `tensors` (in this order, in buckets of `bucket_bytes`) from the trainer's
        broadcast and swap them in, atomically.

        Raises:
            RequestError: INVALID_ARGUMENT for a refused update (checked before the transfer);
                UNAVAILABLE when the trainer fails mid-transfer (nothing changed).
        """
        return self._control(UpdateWeights(
            0, weight_version, "distributed", tensors=list(tensors), group_name=group_name,
            bucket_bytes=bucket_bytes, flush_cache=flush_cache,
        ))

    def destroy_weight_update_group(self, group_name: str = DEFAULT_GROUP_NAME) -> None:
        """Leave the weight-update group (a no-op when not joined)."""
        self._control(DestroyWeightUpdateGroup(0, group_name))

    def _control(self, message) -> ControlReply:
        reply, _ = self.engine.rollout.handle(message)
        return reply.checked()
