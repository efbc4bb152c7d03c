"""What a vLLM server's ``/metrics`` (Prometheus text) tells a client: its KV block size,
how many data-parallel engines answer behind its URL, its prefix-cache counters and the
requests it runs.

Examples
--------
>>> text = '''# HELP vllm:prefix_cache_hits_total Prefix cache hits.
... vllm:prefix_cache_hits_total{engine="0",model_name="m"} 96.0
... vllm:prefix_cache_hits_total{engine="1",model_name="m"} 32.0
... vllm:cache_config_info{block_size="32",engine="0"} 1.0'''
>>> samples = parse(text)
>>> total(samples, "vllm:prefix_cache_hits")
128.0
>>> engines(samples), block_size(samples)
(2, 32)
>>> requests(parse('''vllm:num_requests_running{engine="0"} 3.0
... vllm:num_requests_waiting{engine="0"} 2.0
... vllm:num_requests_running{engine="1"} 1.0'''))
{'0': 5, '1': 1}
"""

from __future__ import annotations

import re

__all__ = ["parse", "total", "engines", "block_size", "requests", "Sample"]

Sample = tuple[str, dict[str, str], float]
_LINE = re.compile(r"^([A-Za-z_:][\w:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> list[Sample]:
    """Every sample of a Prometheus text page as ``(name, labels, value)``."""
    out = []
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        out.append((match.group(1), dict(_LABEL.findall(match.group(2) or "")), value))
    return out


def total(samples: list[Sample], name: str) -> float:
    """The sum of counter ``name`` over its labels (``_total`` suffix or not)."""
    names = {name, name + "_total"}
    return sum(value for n, _, value in samples if n in names)


def engines(samples: list[Sample]) -> int:
    """How many engines (data-parallel ranks) the page reports (1 where it names none)."""
    return max(1, len({labels["engine"] for _, labels, _ in samples if "engine" in labels}))


def block_size(samples: list[Sample]) -> int | None:
    """The KV block size in ``vllm:cache_config_info`` (None where the page has none)."""
    for name, labels, _ in samples:
        if name == "vllm:cache_config_info" and labels.get("block_size", "").isdigit():
            return int(labels["block_size"])
    return None


def requests(samples: list[Sample]) -> dict[str, int]:
    """Requests running and waiting on each engine (by its ``engine`` label, ``""`` where the
    page names none): the server's own load, every client's requests together."""
    out: dict[str, int] = {}
    for name, labels, value in samples:
        if name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            engine = labels.get("engine", "")
            out[engine] = out.get(engine, 0) + int(value)
    return out
