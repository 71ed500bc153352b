"""What listens on this machine's TCP ports, read from ``/proc`` (no tool needed)."""

from __future__ import annotations

import ipaddress
import os

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def _inodes(pid: int) -> set[str]:
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(target[8:-1])
    return out


def listening(pid: int | None = None) -> set[tuple[Address, int]]:
    """The (local address, port) of every listening TCP socket (of process ``pid`` if
    given), IPv4-mapped IPv6 addresses as IPv4."""
    inodes = _inodes(pid) if pid is not None else None
    found: set[tuple[Address, int]] = set()
    for table, size in (("tcp", 4), ("tcp6", 16)):
        with open(f"/proc/net/{table}") as f:
            lines = f.read().splitlines()[1:]
        for line in lines:
            cols = line.split()
            if cols[3] != "0A" or (inodes is not None and cols[9] not in inodes):  # LISTEN
                continue
            address, port = cols[1].split(":")
            raw = bytes.fromhex(address)
            # the kernel prints each 32-bit word in host (little-endian) order
            ip = ipaddress.ip_address(b"".join(raw[i : i + 4][::-1] for i in range(0, size, 4)))
            mapped = getattr(ip, "ipv4_mapped", None)
            found.add((mapped or ip, int(port, 16)))
    return found
