"""Where a Mooncake pool answers: the master's RPC endpoint and its metrics endpoint.

Contract:
    * A pool address is printed and parsed as ``mooncake://HOST:RPC_PORT?metrics=METRICS_PORT``
      (the metrics server runs on the master's host). ``HOST:RPC_PORT`` alone is accepted too;
      such an address has no metrics endpoint, so ``stats`` answers ``None``.
    * Parsing errors are ``ValueError`` naming the text and the expected form.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlsplit

SCHEME = "mooncake"


@dataclass(frozen=True)
class PoolAddress:
    """The master's RPC endpoint and (optionally) its metrics HTTP port on the same host."""

    host: str
    rpc_port: int
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("pool address needs a host")
        for name, port in (("rpc_port", self.rpc_port), ("metrics_port", self.metrics_port)):
            if port is not None and not 0 < port < 65536:
                raise ValueError(f"{name} must be in 1..65535, got {port}")

    @property
    def master(self) -> str:
        """``HOST:RPC_PORT``, the form Mooncake's ``setup`` takes."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metrics_url(self) -> str | None:
        """``http://HOST:METRICS_PORT`` or ``None``."""
        return None if self.metrics_port is None else f"http://{self.host}:{self.metrics_port}"

    def url(self) -> str:
        """The address as users pass it around (``mooncake://HOST:RPC?metrics=M``)."""
        tail = "" if self.metrics_port is None else f"?metrics={self.metrics_port}"
        return f"{SCHEME}://{self.master}{tail}"

    def __str__(self) -> str:
        return self.url()

    @classmethod
    def parse(cls, text: str) -> PoolAddress:
        """Parse ``mooncake://HOST:RPC[?metrics=M]`` or ``HOST:RPC``."""
        form = f"expected {SCHEME}://HOST:RPC_PORT?metrics=METRICS_PORT or HOST:RPC_PORT"
        raw = text.strip()
        if "://" not in raw:
            raw = f"{SCHEME}://{raw}"
        try:
            parts = urlsplit(raw)
            port = parts.port
        except ValueError as e:
            raise ValueError(f"bad pool address {text!r} ({e}); {form}") from None
        if parts.scheme != SCHEME or not parts.hostname or port is None or parts.path not in ("", "/"):
            raise ValueError(f"bad pool address {text!r}; {form}")
        query = parse_qs(parts.query)
        unknown = set(query) - {"metrics"}
        if unknown:
            raise ValueError(f"bad pool address {text!r}: unknown parameter(s) {sorted(unknown)}; {form}")
        metrics = None
        if "metrics" in query:
            value = query["metrics"][-1]
            if not value.isdigit():
                raise ValueError(f"bad pool address {text!r}: metrics port {value!r} is not a number; {form}")
            metrics = int(value)
        return cls(parts.hostname, port, metrics)
