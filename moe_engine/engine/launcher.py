"""Start the ranks of an expert-parallel engine through torch's elastic launcher.

`run_launcher` is the process the front end spawns when `ParallelConfig.ep_size` > 1 (in place
of the single engine-core process). It runs a torch elastic agent
(`torch.distributed.launcher.api.elastic_launch`, the machinery behind `torchrun`) that starts
this node's ranks (`moe_engine.engine.rank.run_rank`) with the rendezvous settings `torchrun`
users know: `--nnodes`, `--node-rank`, `--rdzv-endpoint` (static rendezvous: global rank =
node_rank x ranks per node + local rank). No restarts: a rank that fails fails the engine.
Across nodes, gloo and NCCL are pointed at the interface that routes to the rendezvous host
(`netif.configure_socket_ifname`) unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME are set.

When a rank fails, the agent stops the others and this process reports the first failure
(rank, pid, exit status or signal) to the front end as FATAL, then exits 1.

`moe-serve --node-rank K` (K > 0) on another node runs `launch_ranks` in the foreground: that
node's ranks join the group; global rank 0, on node 0, talks to the front end.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import uuid
from typing import Any

import zmq

from moe_engine.engine import core_proc
from moe_engine.engine.messages import Fatal, encode
from moe_engine.engine.monitor import FRONTEND_TIMEOUT_S, FrontEndMonitor
from moe_engine.engine.netif import configure_socket_ifname
from moe_engine.startup.config import EngineConfig

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (for a single-node rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def describe_failure(rank: int, failure: Any) -> str:
    """One line about a failed rank, from torch elastic's `ProcessFailure`."""
    code = failure.exitcode
    if code is not None and code < 0:
        try:
            how = f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited with status {code}"
    return f"rank {rank} (pid {failure.pid}) {how}"


def describe_failures(failures: dict[int, Any]) -> str:
    """All failed ranks, root cause first: a rank killed by a signal (the others then failed
    in their collectives), else the earliest failure."""

    def order(item: tuple[int, Any]) -> tuple[bool, float, int]:
        rank, failure = item
        killed = failure.exitcode is not None and failure.exitcode < 0
        return (not killed, failure.timestamp, rank)

    ranked = sorted(failures.items(), key=order)
    return "; ".join(describe_failure(rank, failure) for rank, failure in ranked)


def launch_ranks(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    core_factory: str = core_proc.DEFAULT_CORE_FACTORY,
    log_level: int = logging.INFO,
    heartbeat_addr: str | None = None,
    frontend_timeout_s: float = FRONTEND_TIMEOUT_S,
) -> str | None:
    """Run this node's ranks until they stop.

    Args:
        config: the engine config (`parallel` gives ep_size, nnodes, node_rank,
            rdzv_endpoint).
        input_addr, output_addr: the front end's ZeroMQ addresses (used by global rank 0).
        heartbeat_addr: the front end's heartbeat address, watched by every rank of this node
            (None on a node without the front end); frontend_timeout_s: the silence bound.

    Returns:
        None when every rank exited 0, else a one-line description of the first failure.
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from moe_engine.engine.rank import run_rank

    par = config.parallel
    endpoint = par.rdzv_endpoint or f"127.0.0.1:{free_port()}"
    # the ranks inherit this environment: gloo and NCCL bind the interface that reaches node 0
    configure_socket_ifname(endpoint, par.nnodes)
    launch = LaunchConfig(
        min_nodes=par.nnodes,
        max_nodes=par.nnodes,
        nproc_per_node=par.ep_size // par.nnodes,
        run_id=f"moe-engine-{uuid.uuid4().hex[:8]}" if par.nnodes == 1 else "moe-engine",
        rdzv_backend="static",
        rdzv_endpoint=endpoint,
        rdzv_configs={"rank": par.node_rank, "timeout": 900},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
    )
    logger.info(
        "starting %d rank(s) on node %d of %d; rendezvous at %s%s",
        launch.nproc_per_node,
        par.node_rank,
        par.nnodes,
        endpoint,
        " (waiting for every node to join)" if par.nnodes > 1 else "",
    )
    try:
        elastic_launch(launch, run_rank)(
            config, input_addr, output_addr, core_factory, log_level, heartbeat_addr,
            frontend_timeout_s,
        )
    except ChildFailedError as exc:
        return describe_failures(exc.failures)
    except Exception as exc:  # noqa: BLE001 - rendezvous and agent errors
        return f"the rank launcher failed: {type(exc).__name__}: {exc}"
    return None


def run_launcher(
    config: EngineConfig,
    input_addr: str,
    output_addr: str,
    parent_pid: int,
    core_factory: str = core_proc.DEFAULT_CORE_FACTORY,
    log_level: int = logging.INFO,
    heartbeat_addr: str | None = None,
    frontend_timeout_s: float = FRONTEND_TIMEOUT_S,
) -> None:
    """The front end's child process for ep_size > 1: launch the ranks, report a failure.

    The process leaves the front end's process group (its own session), so a signal sent to
    the group (Ctrl-C, `kill -- -PGID`) reaches only the front end, which drains and then
    stops the ranks with Shutdown. A monitor ends it (and so its ranks) if the front end dies;
    each rank watches the front end's heartbeats itself.
    """
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s [launcher] %(message)s")
    os.setsid()
    ctx = zmq.Context()
    FrontEndMonitor(ctx, "rank launcher", parent_pid, None).start()
    failure = launch_ranks(
        config, input_addr, output_addr, core_factory, log_level, heartbeat_addr,
        frontend_timeout_s,
    )
    if failure is None:
        os._exit(0)
    logger.error("%s", failure)
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(output_addr)
    sock.send(encode(Fatal(failure)))
    sock.close()
    ctx.term()
    os._exit(1)
