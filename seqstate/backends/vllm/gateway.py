"""vllm-router (the vLLM project's Rust router, PyPI ``vllm-router``) in front of vLLM
servers: one URL for clients, requests spread over the servers by a policy.  ``make vllm``
installs it in the server environment; `Router` starts it as `Server` starts a server, and
``python -m seqstate.vllm router URL ...`` from the command line.

With ``policy="consistent_hash"`` the router hashes each request's ``X-Session-ID`` header,
the lineage key seqstate sends (`seqstate.backends.vllm.routing.Sessions`), so a state's
lineage stays on one server and finds its prefix cached there.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from seqstate.backends.vllm.server import Process, free_port, server_python
from seqstate.errors import ArgumentError, ModelNotAvailable

__all__ = ["Router", "POLICIES", "ROUTER_VERSION"]

ROUTER_VERSION = "0.1.17"
POLICIES = ("consistent_hash", "cache_aware", "round_robin", "random", "power_of_two",
            "kv_aware", "sticky_least_loaded")


class Router(Process):
    """A vllm-router process in front of the servers at ``urls``, on ``host:port``
    (loopback and a free port by default).  ``start()`` returns once its ``/health``
    answers; ``stop()`` (or leaving the ``with`` block) ends it.  ``url`` is what
    `seqstate.models.vllm` connects to.

    Parameters
    ----------
    urls : sequence of str
        The vLLM servers (each up: the router waits for them as it starts).
    policy : str
        vllm-router's ``--policy`` (`POLICIES`): ``consistent_hash`` keeps each lineage on
        one server by seqstate's session header; ``cache_aware``, the router's default,
        matches prompts' text in a tree of its own.
    python : str or None
        The server environment's Python (`server_python`); its ``bin`` holds ``vllm-router``.
    extra_args : tuple of str
        Other flags, passed last and verbatim.
    **flags
        vllm-router's flags by name: ``retry_max_retries=3`` is ``--retry-max-retries 3``,
        ``disable_circuit_breaker=True`` is ``--disable-circuit-breaker``.  Its Prometheus
        port is a free one unless ``prometheus_port`` is given (two routers on one machine
        would clash on its default).
    """

    what = "vllm-router"

    def __init__(self, urls: Sequence[str], policy: str = "consistent_hash", *,
                 port: int | None = None, host: str = "127.0.0.1",
                 python: str | os.PathLike | None = None, extra_args: tuple[str, ...] = (),
                 log: Any = None, **flags: Any) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls or not all(isinstance(u, str) and u.startswith(("http://", "https://"))
                               for u in urls):
            raise ArgumentError(f"a router takes the URLs of vLLM servers (http:// or "
                                f"https://), got {urls!r}")
        if policy not in POLICIES:
            raise ArgumentError(f"vllm-router has no policy {policy!r}; it has "
                                f"{', '.join(POLICIES)}")
        self.binary = Path(server_python(python)).parent / "vllm-router"
        if not self.binary.is_file():
            raise ModelNotAvailable(
                f"vllm-router is not installed in the server environment ({self.binary}): "
                f"run `make vllm`, or pip install vllm-router=={ROUTER_VERSION} there")
        self.urls = [u.rstrip("/") for u in urls]
        self.policy = policy
        self.host = host
        self.port = free_port(host) if port is None else int(port)
        flags.setdefault("prometheus_port", free_port(host))
        self.flags = flags
        self.extra_args = tuple(extra_args)
        self.log = log
        self.process = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [str(self.binary), "--worker-urls", *self.urls, "--policy", self.policy,
                "--host", self.host, "--port", str(self.port), *_flags(self.flags),
                *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)                    # seqstate's environment stays out
        return env


def _flags(flags: dict[str, Any]) -> list[str]:
    """Keywords as command-line flags: ``a_b=1`` is ``--a-b 1``, True a bare flag, False
    and None none, a list or tuple its items after the flag.

    Examples
    --------
    >>> _flags({"retry_max_retries": 3, "disable_circuit_breaker": True, "x": None,
    ...         "request_id_headers": ["x-a", "x-b"]})
    ['--retry-max-retries', '3', '--disable-circuit-breaker', '--request-id-headers', 'x-a', 'x-b']
    """
    out: list[str] = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        out.append("--" + name.replace("_", "-"))
        if isinstance(value, (list, tuple)):
            out += [str(v) for v in value]
        elif value is not True:
            out.append(str(value))
    return out
