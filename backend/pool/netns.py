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
    * Listen interfaces: ``netns_problem(listen_interfaces)`` also accepts a namespace whose
      interfaces are ``lo`` and exactly the interfaces named (e.g. a namespace holding only the
      cluster's RDMA or data interface): the listeners are reachable on those and nothing else. Every
      named interface must be in the namespace. Naming an interface does not make Mooncake bind it
      alone: what is checked is that nothing else is there to listen on.
    * ``check_listeners(allow_public_listeners, how_to_allow, listen_interfaces=None)`` is the one
      decision every starter of Mooncake processes makes (``kvpool pool up``, ``start_local_pool``,
      ``MooncakePool``, ``MooncakeTransport``): in a namespace that passes it returns ``None``;
      otherwise it raises ``PublicListenersRefused`` ("refusing to start: <problem> Or
      <how_to_allow> to start anyway.") unless ``allow_public_listeners`` is true, in which case it
      returns the problem for the caller to show as a warning. ``listen_interfaces=None`` reads them
      from ``KVPOOL_LISTEN_INTERFACES`` (comma-separated names; unset or empty: none).
    * ``loopback_up()`` sets IFF_UP on ``lo`` (``SIOCSIFFLAGS``, what ``ip link set lo up`` does; needs
      ``CAP_NET_ADMIN`` in the namespace, which ``unshare -n`` as root or ``unshare -rn`` gives).
      ``python -m kvpool.backend.pool.netns COMMAND [ARG...]`` brings ``lo`` up and executes
      ``COMMAND``, for machines without ``ip``: ``unshare -n python -m kvpool.backend.pool.netns
      <command>``. A failure is one ``error:`` line and exit status 2.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import sys
from collections.abc import Sequence

IFF_UP = 0x1
SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFREQ = "16sH22x"   # struct ifreq: the name, the flags, the rest of the union
HOW_TO = "unshare -n sh -c 'ip link set lo up; exec <command>'"
LISTEN_ENV = "KVPOOL_LISTEN_INTERFACES"


class PublicListenersRefused(RuntimeError):
    """Mooncake would listen beyond loopback and the caller did not allow public listeners."""


def interfaces() -> list[str]:
    """Names of the network interfaces in this process's network namespace."""
    return sorted(name for _, name in socket.if_nameindex())


def interface_up(name: str) -> bool:
    """Whether interface ``name`` exists in this namespace and has the IFF_UP flag."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, struct.pack(IFREQ, name.encode()[:15], 0))
        except OSError:
            return False
    return bool(struct.unpack(IFREQ, res)[1] & IFF_UP)


def loopback_up() -> None:
    """Set IFF_UP on ``lo`` in this namespace (``OSError`` without ``CAP_NET_ADMIN`` there)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack(IFREQ, fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, struct.pack(IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack(IFREQ, b"lo", flags | IFF_UP))


def listen_interfaces_from_env() -> tuple[str, ...]:
    """The interfaces ``KVPOOL_LISTEN_INTERFACES`` names (comma-separated), in order, each once."""
    names = (n.strip() for n in os.environ.get(LISTEN_ENV, "").split(","))
    return tuple(dict.fromkeys(n for n in names if n))


def netns_problem(listen_interfaces: Sequence[str] = ()) -> str | None:
    """``None`` in a namespace holding ``lo`` (up) and at most ``listen_interfaces``, all of them
    present; otherwise what is wrong and the fix."""
    names = interfaces()
    missing = [n for n in listen_interfaces if n not in names]
    if missing:
        return (f"listen interface(s) {', '.join(repr(n) for n in missing)} are not in this network namespace "
                f"(its interfaces: {', '.join(names) or 'none'}).")
    allowed = {"lo", *listen_interfaces}
    others = [n for n in names if n not in allowed]
    if others:
        besides = "lo" + (f" and the listen interfaces ({', '.join(listen_interfaces)})" if listen_interfaces else "")
        return (
            f"network interfaces other than {besides} are visible ({', '.join(others)}): Mooncake's transfer "
            f"engine would listen on all of them. Run inside a private network namespace: {HOW_TO} "
            f"(needs root, or try 'unshare -rn'), or in one holding only the interfaces to listen on, named "
            f"with {LISTEN_ENV} (kvpool pool up: --listen-interface)."
        )
    if not interface_up("lo"):
        return f"the loopback interface is down in this network namespace; bring it up first: {HOW_TO}"
    return None


def check_listeners(allow_public_listeners: bool, how_to_allow: str,
                    listen_interfaces: Sequence[str] | None = None) -> str | None:
    """Refuse (``PublicListenersRefused``) to start Mooncake listeners in a namespace holding more than
    ``lo`` and ``listen_interfaces`` (``None``: ``KVPOOL_LISTEN_INTERFACES``) unless
    ``allow_public_listeners``; return the problem to warn about when allowed, else ``None``."""
    listen = listen_interfaces_from_env() if listen_interfaces is None else tuple(listen_interfaces)
    problem = netns_problem(listen)
    if problem and not allow_public_listeners:
        raise PublicListenersRefused(f"refusing to start: {problem} Or {how_to_allow} to start anyway.")
    return problem


def main(argv: Sequence[str]) -> int:
    """``python -m kvpool.backend.pool.netns COMMAND [ARG...]``: bring ``lo`` up, then execute COMMAND."""
    if not argv:
        print("error: usage: python -m kvpool.backend.pool.netns COMMAND [ARG...] (brings lo up, then runs "
              "COMMAND; inside a private namespace: unshare -n python -m kvpool.backend.pool.netns COMMAND)",
              file=sys.stderr)
        return 2
    try:
        loopback_up()
    except OSError as e:
        print(f"error: cannot bring the loopback interface up: {e.strerror} (needs CAP_NET_ADMIN in this "
              f"network namespace: run it under 'unshare -n' as root, or 'unshare -rn')", file=sys.stderr)
        return 2
    try:
        os.execvp(argv[0], list(argv))
    except OSError as e:
        print(f"error: {argv[0]}: {e.strerror}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
