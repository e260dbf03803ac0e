"""Runtime expert-parallel load balancing (EPLB): experts that move between ranks while serving.

`controller.EplbController` decides (from the routing load of a window of steps, summed over
the ranks) when and where the experts go; `mover.ExpertMover` moves their weights over the
device group, a chunk per step, and swaps them in on every rank at once; `placement` builds
the placement served first, with the redundant slots filled.
"""
