"""Is this process inside a private network namespace? (Mooncake's listeners bind all addresses.)

Mooncake's transfer engine binds its handshake and data listeners to the wildcard address in
every client and store process, whatever ``MC_TCP_BIND_ADDRESS`` says. kvpool's rule is that
servers bind 127.0.0.1, so Mooncake processes run inside a network namespace whose only
interface is ``lo``: ``unshare -n sh -c 'ip link set lo up; exec <command>'``.

Contract:
    * ``netns_problem()`` returns ``None`` when the only network interface of this process's
      namespace is ``lo`` and it is up, otherwise a one-paragraph explanation with the command that
      fixes it. Interfaces come from ``socket.if_nameindex()`` and flags from ``SIOCGIFFLAGS``, both
      of which see the calling process's namespace (``/sys/class/net`` does not: it shows the
      namespace sysfs was mounted in).
    * ``check_listeners(allow_public_listeners, how_to_allow)`` is the one decision every starter of
      Mooncake processes makes (``kvpool pool up``, ``start_local_pool``, ``MooncakePool``,
      ``MooncakeTransport``): inside a private namespace it returns ``None``; outside one it raises
      ``PublicListenersRefused`` ("refusing to start: <problem> Or <how_to_allow> to start
      anyway.") unless ``allow_public_listeners`` is true, in which case it returns the problem for
      the caller to show as a warning.
"""

from __future__ import annotations

import fcntl
import socket
import struct

IFF_UP = 0x1
SIOCGIFFLAGS = 0x8913
HOW_TO = "unshare -n sh -c 'ip link set lo up; exec <command>'"


class PublicListenersRefused(RuntimeError):
    """Mooncake would listen beyond loopback and the caller did not allow public listeners."""


def interfaces() -> list[str]:
    """Names of the network interfaces in this process's network namespace."""
    return sorted(name for _, name in socket.if_nameindex())


def interface_up(name: str) -> bool:
    """Whether interface ``name`` exists in this namespace and has the IFF_UP flag."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, struct.pack("16sH22x", name.encode()[:15], 0))
        except OSError:
            return False
    return bool(struct.unpack("16sH22x", res)[1] & IFF_UP)


def netns_problem() -> str | None:
    """``None`` inside a private namespace with ``lo`` up; otherwise what is wrong and the fix."""
    others = [n for n in interfaces() if n != "lo"]
    if others:
        return (
            f"network interfaces other than lo are visible ({', '.join(others)}): Mooncake's transfer "
            f"engine would listen on all of them. Run inside a private network namespace: {HOW_TO} "
            "(needs root, or try 'unshare -rn')."
        )
    if not interface_up("lo"):
        return f"the loopback interface is down in this network namespace; bring it up first: {HOW_TO}"
    return None


def check_listeners(allow_public_listeners: bool, how_to_allow: str) -> str | None:
    """Refuse (``PublicListenersRefused``) to start Mooncake listeners outside a private namespace
    unless ``allow_public_listeners``; return the problem to warn about when allowed, else ``None``."""
    problem = netns_problem()
    if problem and not allow_public_listeners:
        raise PublicListenersRefused(f"refusing to start: {problem} Or {how_to_allow} to start anyway.")
    return problem
