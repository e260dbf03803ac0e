"""The process groups of one expert-parallel rank, and a clear error when they cannot form.

Two kinds of group (DESIGN.md section 1): gloo groups for control messages, finding dead
ranks and startup (host objects), and the device group for activations (the communicator's
all-to-all): NCCL exactly when the engine's device is cuda, the default gloo group otherwise.
The default group is always gloo, so a CPU engine on a machine that has GPUs never hands
CPU tensors to NCCL.

Before joining, each rank publishes the address gloo will advertise (`netif.
advertised_address`) in the rendezvous store (the TCPStore of torch elastic's agent, at
MASTER_ADDR:MASTER_PORT). If the mesh cannot form (gloo's "connectFullMesh failed", a
timeout, NCCL's first collective failing), `join_groups` raises `MeshError` whose message names
the address every rank advertised and the variables that fix it, instead of a raw traceback.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from moe_engine.engine import netif

logger = logging.getLogger(__name__)

#: Store keys of the advertised addresses: PREFIX + str(rank).
ADDRESS_KEY_PREFIX = "moe_engine/advertised_address/"
#: How long a failing rank waits for the other ranks' addresses in the store (seconds).
ADDRESS_WAIT_S = 5.0
#: How long a rank tries to reach the rendezvous store to publish its address (seconds).
STORE_CONNECT_S = 10.0
#: How long rank 0 waits for each rank at the monitored barrier that names dead ranks (seconds).
HEALTH_CHECK_S = 3.0


class MeshError(RuntimeError):
    """The ranks could not connect to each other; the message says what each advertised."""


@dataclass
class RankGroups:
    """The groups of one rank.

    Attributes:
        control: gloo, the lockstep loop's broadcast/gather of messages and reports.
        health: gloo, only for the monitored barrier that names dead ranks.
        startup: gloo with the startup timeout, the all-gather of build results.
        device: the communicator's group: NCCL on cuda, the default gloo group on cpu.
    """

    control: Any
    health: Any
    startup: Any
    device: Any


def device_backend(device: str) -> str:
    """The torch.distributed backend of the device group: "nccl" for cuda, else "gloo"."""
    return "nccl" if device == "cuda" else "gloo"


def join_groups(
    rank: int,
    world_size: int,
    device: str,
    timeout_s: float,
    startup_timeout_s: float,
    local_rank: int = 0,
) -> RankGroups:
    """Join the default (gloo) group and create this rank's groups (env:// rendezvous).

    On cuda, binds this process to GPU `local_rank` first (`torch.cuda.set_device`) and runs
    one small all-reduce on the NCCL group, so a network problem shows at startup rather than
    at the first all-to-all.

    Args:
        rank, world_size: this rank and the number of ranks.
        device: the engine's device ("cpu" or "cuda", `engine.device.engine_device(config).type`).
        timeout_s: the collectives' timeout (seconds); startup_timeout_s: the startup group's.
        local_rank: this rank's index on its node (LOCAL_RANK), its GPU on cuda.

    Raises:
        MeshError: the groups could not form; the message names what each rank advertised.
    """
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    store = _rendezvous_store()
    mine = describe_advertised()
    if store is not None:
        store.set(f"{ADDRESS_KEY_PREFIX}{rank}", mine)
    timeout = timedelta(seconds=timeout_s)
    try:
        dist.init_process_group("gloo", timeout=timeout)
        groups = RankGroups(
            control=dist.new_group(backend="gloo", timeout=timeout),
            health=dist.new_group(backend="gloo", timeout=timeout),
            startup=dist.new_group(backend="gloo", timeout=timedelta(seconds=startup_timeout_s)),
            device=dist.group.WORLD,
        )
        if device == "cuda":
            groups.device = dist.new_group(backend="nccl", timeout=timeout)
            probe = torch.ones(1, device="cuda")
            dist.all_reduce(probe, group=groups.device)
            torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - gloo/NCCL raise several types for one cause
        advertised = gather_addresses(store, world_size, mine, rank)
        raise MeshError(mesh_failure_message(exc, advertised)) from exc
    return groups


def describe_advertised(env: Any = os.environ) -> str:
    """What this rank advertises, as text: "ADDRESS (host NAME, GLOO_SOCKET_IFNAME=...)"."""
    ifname = env.get("GLOO_SOCKET_IFNAME") or "unset"
    return (
        f"{netif.advertised_address(env)} (host {socket.gethostname()}, "
        f"GLOO_SOCKET_IFNAME={ifname})"
    )


def gather_addresses(store: Any, world_size: int, mine: str, rank: int) -> list[str | None]:
    """Every rank's `describe_advertised` text from the store (None where a rank's is not
    there within ADDRESS_WAIT_S); this rank's own text when there is no store."""
    found: list[str | None] = [None] * world_size
    found[rank] = mine
    if store is None:
        return found
    store.set_timeout(timedelta(seconds=ADDRESS_WAIT_S))
    for other in range(world_size):
        if other == rank:
            continue
        try:
            found[other] = store.get(f"{ADDRESS_KEY_PREFIX}{other}").decode()
        except Exception:  # noqa: BLE001 - a timeout or a store that went away
            continue
    return found


def mesh_failure_message(error: BaseException, advertised: list[str | None]) -> str:
    """One message for a mesh that could not form: the cause's first line, what each rank
    advertised, and the variables that fix it."""
    cause = (str(error).strip().splitlines() or [type(error).__name__])[0]
    ranks = "; ".join(
        f"rank {r} advertised {a if a is not None else '(unknown: not in the store)'}"
        for r, a in enumerate(advertised)
    )
    loopback = any(a is not None and netif.is_loopback(a.split()[0]) for a in advertised)
    hint = (
        "a loopback address cannot be reached from another node. " if loopback else ""
    )
    return (
        f"the ranks could not connect to each other ({type(error).__name__}: {cause[:300]}). "
        f"{ranks}. {hint}Set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME on every node to the "
        "network interface that reaches the other nodes (the one `ip route get "
        "<rendezvous host>` names)."
    )


def _rendezvous_store() -> Any:
    """A client of torch elastic's agent store at MASTER_ADDR:MASTER_PORT (it exists before
    the ranks start: TORCHELASTIC_USE_AGENT_STORE=True), or None (another launcher, or not
    reachable: the other ranks' addresses are then unknown in the error)."""
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not host or not port or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    try:
        return dist.TCPStore(
            host, int(port), is_master=False, timeout=timedelta(seconds=STORE_CONNECT_S),
            wait_for_workers=False,
        )
    except Exception as exc:  # noqa: BLE001 - the init below reports the real failure
        logger.warning("rendezvous store %s:%s not reachable for addresses: %s", host, port, exc)
        return None


def unresponsive_ranks(rank: int, rank_pids: list[int], health_group: Any) -> str:
    """After a failed collective on `rank`: which other ranks no longer answer, as text for
    the error (`rank_pids`: every rank's pid when all run on this node, else empty).

    Ranks on this node are checked by pid (gone, zombie or stopped); otherwise a monitored
    barrier on the health group names the ranks that do not reach it.
    """
    deadline = time.monotonic() + HEALTH_CHECK_S  # a killed peer may still be exiting
    while rank_pids:
        found = [
            f"rank {other} (pid {pid}) {state}"
            for other, pid in enumerate(rank_pids)
            if other != rank and (state := process_state(pid)) is not None
        ]
        if found:
            return "; ".join(found)
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    try:
        dist.monitored_barrier(
            group=health_group,
            timeout=timedelta(seconds=HEALTH_CHECK_S),
            wait_all_ranks=True,
        )
    except Exception as exc:  # noqa: BLE001 - the barrier's message names the ranks
        return str(exc).strip().splitlines()[0]
    return "all ranks still answer"


def process_state(pid: int) -> str | None:
    """"is gone", "is a zombie" or "is stopped" for a local process in that state, else None
    (running, or not on this node)."""
    try:
        stat = open(f"/proc/{pid}/stat").read()  # noqa: SIM115 - one short read
    except FileNotFoundError:
        return "is gone"
    except OSError:
        return None
    state = stat.rsplit(")", 1)[1].split()[0]
    return {"Z": "is a zombie (it died)", "X": "is gone", "T": "is stopped"}.get(state)
