"""The network interface gloo and NCCL use across nodes, and what each rank advertises.

Without `GLOO_SOCKET_IFNAME`, gloo binds and advertises the address the machine's hostname
resolves to, and falls back to the loopback address when that address cannot be bound
(torch `ProcessGroupGloo::createDefaultDevice`). In a container or network namespace the
hostname often resolves to 127.0.0.1 (or to nothing bindable), so with `--nnodes 2` every
rank advertises 127.0.0.1 and the mesh fails after a timeout with gloo's
"connectFullMesh failed ... remote=[127.0.0.1]". NCCL's own interface choice
(`NCCL_SOCKET_IFNAME`) can go wrong in the same places.

Before the ranks start, `configure_socket_ifname` picks the interface whose address routes to
the rendezvous host: the kernel's routing answer, read from a connected UDP socket's
`getsockname()` (no packet is sent), mapped to an interface name with `socket.if_nameindex`
and the SIOCGIFADDR ioctl (netdevice(7)), or `psutil.net_if_addrs` for addresses the ioctl
does not show (secondary addresses) when psutil is installed. It sets both variables unless
either is already set. `advertised_address` says what gloo will advertise, for the error a
mesh that cannot form ends with (`moe_engine.engine.rank_groups`).

Linux only (SIOCGIFADDR); IPv4 only (an IPv6-only rendezvous host is left alone, logged).
"""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import MutableMapping

logger = logging.getLogger(__name__)

#: The variables that choose the interface of gloo and of NCCL's bootstrap/socket transport.
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
#: netdevice(7): get the (primary) IPv4 address of an interface.
SIOCGIFADDR = 0x8915
#: Any port: a UDP connect() only asks the kernel for a route, nothing is sent.
_PROBE_PORT = 9


class NetworkInterfaceError(RuntimeError):
    """No interface could be found for the rendezvous host (the message says why)."""


def split_endpoint(endpoint: str) -> tuple[str, int | None]:
    """"host:port" (or "host", "[v6]:port") -> (host, port or None)."""
    if endpoint.startswith("["):
        host, _, rest = endpoint[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") else None
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        return endpoint, None
    return host, int(port)


def route_source_address(host: str) -> str:
    """The local IPv4 address the kernel would send from to reach `host`.

    Raises:
        NetworkInterfaceError: `host` does not resolve to an IPv4 address, or no route
            reaches it (e.g. ENETUNREACH).
    """
    try:
        infos = socket.getaddrinfo(host, _PROBE_PORT, socket.AF_INET, socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise NetworkInterfaceError(f"rendezvous host {host!r} does not resolve: {exc}") from exc
    target = infos[0][4]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(target)
        except OSError as exc:
            raise NetworkInterfaceError(
                f"no route to the rendezvous host {host} ({target[0]}): "
                f"{errno.errorcode.get(exc.errno, exc.errno)} {exc.strerror}"
            ) from exc
        return probe.getsockname()[0]


def interface_addresses() -> dict[str, str]:
    """{interface name: primary IPv4 address} of the interfaces that have one (SIOCGIFADDR)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), SIOCGIFADDR, request)
            except OSError:  # EADDRNOTAVAIL: no IPv4 address on this interface
                continue
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def interface_of_address(address: str) -> str | None:
    """The name of the interface holding IPv4 `address`, or None."""
    for name, addr in interface_addresses().items():
        if addr == address:
            return name
    try:
        import psutil  # optional: it also sees secondary addresses
    except ImportError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    return None


def interface_for_endpoint(endpoint: str) -> tuple[str, str]:
    """(interface name, its address) that routes to the host of `endpoint` ("host:port").

    Raises:
        NetworkInterfaceError: the host does not resolve, is unreachable, or the source
            address belongs to no interface this process can see.
    """
    host, _ = split_endpoint(endpoint)
    address = route_source_address(host)
    name = interface_of_address(address)
    if name is None:
        raise NetworkInterfaceError(
            f"address {address} routes to the rendezvous host {host} but no interface "
            "holding it was found"
        )
    return name, address


def configure_socket_ifname(
    endpoint: str | None, nnodes: int, env: MutableMapping[str, str] = os.environ
) -> str | None:
    """Set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME in `env` to the interface that routes to
    the rendezvous host, for runs over more than one node.

    Nothing changes for one node, without an endpoint, or when either variable is already
    set (the user's choice wins; both are left as they are). A host that does not resolve or
    cannot be routed to is logged and left to the rendezvous, which then fails naming it.

    Returns:
        The interface name set, or None when nothing was set.
    """
    if nnodes <= 1 or not endpoint:
        return None
    preset = {var: env[var] for var in IFNAME_VARS if env.get(var)}
    if preset:
        logger.info(
            "network interface from the environment: %s",
            ", ".join(f"{k}={v}" for k, v in preset.items()),
        )
        return None
    try:
        name, address = interface_for_endpoint(endpoint)
    except NetworkInterfaceError as exc:
        logger.warning(
            "%s; GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME left unset (set them to the interface "
            "that reaches the other nodes)", exc,
        )
        return None
    for var in IFNAME_VARS:
        env[var] = name
    logger.info(
        "network interface %s (%s) routes to the rendezvous %s; set GLOO_SOCKET_IFNAME / "
        "NCCL_SOCKET_IFNAME to override", name, address, endpoint,
    )
    return name


def advertised_address(env: MutableMapping[str, str] = os.environ) -> str:
    """The address gloo binds and advertises to the other ranks in this environment.

    GLOO_SOCKET_IFNAME's interface address (the first one listed) when set; else, as gloo
    does, the hostname's address when it can be bound here, else the loopback address.
    """
    ifname = env.get("GLOO_SOCKET_IFNAME")
    if ifname:
        name = ifname.split(",")[0]
        return interface_addresses().get(name, f"interface {name} (no IPv4 address)")
    hostname = socket.gethostname()
    try:
        infos = socket.getaddrinfo(hostname, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror:
        return "127.0.0.1"
    for info in infos:
        address = info[4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((address, 0))
            except OSError:
                continue
            return address
    return "127.0.0.1"


def is_loopback(address: str) -> bool:
    """Whether `address` is an IPv4/IPv6 loopback address (False for non-addresses)."""
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
