"""Is this process inside a private network namespace? (Mooncake's listeners bind all addresses.)

Mooncake's transfer engine binds its handshake and data listeners to the wildcard address in
every client and store process, whatever ``MC_TCP_BIND_ADDRESS`` says. kvpool's rule is that
servers bind 127.0.0.1, so Mooncake processes run inside a network namespace whose only
interface is ``lo``: ``unshare -n sh -c 'ip link set lo up; exec <command>'``.

Contract: ``netns_problem()`` returns ``None`` when the only network interface is ``lo`` and it is
up, otherwise a one-paragraph explanation with the command that fixes it.
"""

from __future__ import annotations

import os
from pathlib import Path

IFF_UP = 0x1
HOW_TO = "unshare -n sh -c 'ip link set lo up; exec <command>'"


def interfaces(sys_class_net: Path = Path("/sys/class/net")) -> list[str]:
    """Names of the network interfaces visible to this process."""
    try:
        return sorted(os.listdir(sys_class_net))
    except OSError:
        return []


def loopback_up(sys_class_net: Path = Path("/sys/class/net")) -> bool:
    """Whether ``lo`` exists and has the IFF_UP flag."""
    try:
        flags = int((sys_class_net / "lo" / "flags").read_text().strip(), 16)
    except (OSError, ValueError):
        return False
    return bool(flags & IFF_UP)


def netns_problem(sys_class_net: Path = Path("/sys/class/net")) -> str | None:
    """``None`` inside a private namespace with ``lo`` up; otherwise what is wrong and the fix."""
    names = interfaces(sys_class_net)
    others = [n for n in names if n != "lo"]
    if others:
        return (
            f"network interfaces other than lo are visible ({', '.join(others)}): Mooncake's transfer "
            f"engine would listen on all of them. Run inside a private network namespace: {HOW_TO} "
            "(needs root, or try 'unshare -rn')."
        )
    if not loopback_up(sys_class_net):
        return f"the loopback interface is down in this network namespace; bring it up first: {HOW_TO}"
    return None
