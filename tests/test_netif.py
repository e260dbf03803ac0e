"""The network interface chosen for gloo/NCCL across nodes, and the error of a mesh that
cannot form (moe_engine.engine.netif, moe_engine.engine.rank_groups).

The real two-node case needs two network namespaces (root), so it is not part of the suite;
these tests use the loopback interface every machine has.
"""

from __future__ import annotations

import logging
import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from moe_engine.engine import netif, rank_groups
from moe_engine.engine.netif import NetworkInterfaceError


def test_split_endpoint() -> None:
    assert netif.split_endpoint("10.0.0.1:29500") == ("10.0.0.1", 29500)
    assert netif.split_endpoint("node0") == ("node0", None)
    assert netif.split_endpoint("[fd00::1]:29500") == ("fd00::1", 29500)


def test_loopback_endpoint_routes_through_lo() -> None:
    name, address = netif.interface_for_endpoint("127.0.0.1:29500")
    assert (name, address) == ("lo", "127.0.0.1")
    assert netif.interface_addresses()["lo"] == "127.0.0.1"
    assert netif.interface_of_address("127.0.0.1") == "lo"


def test_unresolvable_endpoint_is_a_clear_error_and_configure_logs_it(caplog) -> None:
    with pytest.raises(NetworkInterfaceError, match="'no-such-host.invalid' does not resolve"):
        netif.interface_for_endpoint("no-such-host.invalid:29500")
    env: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger=netif.__name__):
        assert netif.configure_socket_ifname("no-such-host.invalid:29500", 2, env) is None
    assert env == {}
    assert "does not resolve" in caplog.text and "left unset" in caplog.text


def test_unroutable_endpoint_is_a_clear_error() -> None:
    # the limited broadcast address: connect() is refused (EACCES without SO_BROADCAST, or
    # ENETUNREACH without a default route), so no interface is claimed to reach it
    with pytest.raises(NetworkInterfaceError, match="no route to the rendezvous host"):
        netif.route_source_address("255.255.255.255")


def test_configure_sets_both_variables_and_logs(caplog) -> None:
    env: dict[str, str] = {}
    with caplog.at_level(logging.INFO, logger=netif.__name__):
        assert netif.configure_socket_ifname("127.0.0.1:29500", 2, env) == "lo"
    assert env == {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
    assert (
        "network interface lo (127.0.0.1) routes to the rendezvous 127.0.0.1:29500; set "
        "GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to override" in caplog.text
    )


@pytest.mark.parametrize("preset", [{"GLOO_SOCKET_IFNAME": "eth7"}, {"NCCL_SOCKET_IFNAME": "ib0"}])
def test_configure_leaves_a_user_setting_alone(preset: dict[str, str]) -> None:
    env = dict(preset)
    assert netif.configure_socket_ifname("127.0.0.1:29500", 2, env) is None
    assert env == preset


def test_configure_is_a_no_op_on_one_node() -> None:
    env: dict[str, str] = {}
    assert netif.configure_socket_ifname("127.0.0.1:29500", 1, env) is None
    assert netif.configure_socket_ifname(None, 2, env) is None
    assert env == {}


def test_advertised_address_follows_gloo_socket_ifname() -> None:
    assert netif.advertised_address({"GLOO_SOCKET_IFNAME": "lo"}) == "127.0.0.1"
    assert "no IPv4 address" in netif.advertised_address({"GLOO_SOCKET_IFNAME": "nosuch0"})
    unset = netif.advertised_address({})
    socket.inet_aton(unset)  # an IPv4 address: the hostname's when bindable, else loopback


def test_mesh_failure_message_names_each_rank_and_the_variable() -> None:
    error = RuntimeError("Gloo connectFullMesh failed with ... remote=[127.0.0.1]:4242\nmore")
    text = rank_groups.mesh_failure_message(
        error, ["127.0.0.1 (host a, GLOO_SOCKET_IFNAME=unset)", None]
    )
    assert "connectFullMesh failed" in text and "more" not in text
    assert "rank 0 advertised 127.0.0.1 (host a" in text
    assert "rank 1 advertised (unknown" in text
    assert "loopback address cannot be reached" in text
    assert "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME" in text


def test_join_groups_failure_gathers_addresses_from_the_store(monkeypatch) -> None:
    """A mesh that cannot form: MeshError naming every rank's address (read from the agent
    store), not gloo's raw error."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)
    other = "10.9.9.9 (host other, GLOO_SOCKET_IFNAME=unset)"
    master.set(f"{rank_groups.ADDRESS_KEY_PREFIX}1", other)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(master.port))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")

    def fail(*args, **kwargs):
        raise RuntimeError("Gloo connectFullMesh failed: timed out, remote=[127.0.0.1]")

    monkeypatch.setattr(rank_groups.dist, "init_process_group", fail)
    with pytest.raises(rank_groups.MeshError) as info:
        rank_groups.join_groups(0, 2, "cpu", timeout_s=5, startup_timeout_s=5)
    text = str(info.value)
    assert "rank 0 advertised 127.0.0.1" in text and "GLOO_SOCKET_IFNAME=lo" in text
    assert "rank 1 advertised 10.9.9.9 (host other" in text
    assert master.get(f"{rank_groups.ADDRESS_KEY_PREFIX}0").decode().startswith("127.0.0.1")


def test_device_group_backend_follows_the_engine_device() -> None:
    assert rank_groups.device_backend("cuda") == "nccl"
    assert rank_groups.device_backend("cpu") == "gloo"
