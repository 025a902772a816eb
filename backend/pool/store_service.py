"""One memory-only Mooncake store service: a process that mounts one segment into the pool.

Run as ``python -m kvpool.backend.pool.store_service --master HOST:PORT --segment-bytes N
--ready-file PATH`` (the launcher does this, one process per service -- one per NUMA node in
production).

Contract:
    * SIGTERM and SIGINT are blocked before Mooncake starts its threads, so the main thread
      receives them with ``sigwait`` whichever thread they hit.
    * After ``setup`` the process writes ``{"rc": RC, "segment": NAME, "pid": PID}`` to a temporary
      file and renames it to ``--ready-file`` (readers never see a partial file). ``rc != 0``
      means setup failed; the process then exits with status 1.
    * On SIGTERM/SIGINT it calls ``close()`` (which unmounts the segment: its keys vanish at once)
      and exits with status 0.
    * The environment (``MC_TCP_BIND_ADDRESS``, ``MC_RPC_TIMEOUT_MS``) comes from the launcher.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys


def _write_ready(path: str, report: dict) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(report, f)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--master", required=True, help="master RPC address HOST:PORT")
    ap.add_argument("--segment-bytes", type=int, required=True, help="bytes this service contributes")
    ap.add_argument("--ready-file", required=True, help="where to write the JSON readiness report")
    ap.add_argument("--hostname", default="127.0.0.1", help="local hostname (segment names are HOST:PORT)")
    ap.add_argument("--protocol", default="tcp", help="tcp, or rdma where present")
    ap.add_argument("--rdma-devices", default="", help="RDMA device names (rdma protocol only)")
    args = ap.parse_args(argv)
    if args.segment_bytes <= 0:
        ap.error(f"--segment-bytes must be > 0, got {args.segment_bytes}")

    stop_signals = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stop_signals)

    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup(
        args.hostname, "P2PHANDSHAKE", args.segment_bytes, 0, args.protocol, args.rdma_devices, args.master
    )
    segment = store.get_hostname() if rc == 0 else ""
    _write_ready(args.ready_file, {"rc": rc, "segment": segment, "pid": os.getpid()})
    if rc != 0:
        print(f"store service: setup returned {rc}", file=sys.stderr)
        return 1
    sig = signal.sigwait(stop_signals)
    print(f"store service {segment}: got signal {sig}, closing", file=sys.stderr)
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
