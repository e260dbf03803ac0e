"""New weights into a serving engine without a restart (RL rollouts).

- `targets.py`: where each tensor of an update goes, checked from its name, dtype and shape;
- `staging.py`: the update's values held in host memory, then made to serve (re-quantized
  4-bit experts, rebound kernels);
- `disk.py`: an update read from a checkpoint folder;
- `group.py`, `buckets.py`: the trainer's weight-update process group and the bucket layout
  both sides compute (the trainer's side is `moe_engine.rl`);
- `control.py`: one rank's pause state, weight version and groups (`RolloutControl`).
"""
