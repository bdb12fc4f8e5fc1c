"""What every benchmark script reports the same way: the machine, how busy the rest of it was,
and a markdown table of records."""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def cpu_model() -> str:
    """lscpu's "Model name" (from /proc/cpuinfo), else whatever platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(**versions: str) -> str:
    """"MODEL, N CPUs, Python X" plus the given package versions."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    extra = "".join(f", {name} {version}" for name, version in versions.items())
    return f"{cpu_model()}, {cpus} CPUs, Python {platform.python_version()}{extra}"


def cpu_busy_seconds() -> float | None:
    """CPU seconds the whole machine has spent busy so far (Linux /proc/stat), else None."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def markdown_table(rows: Iterable[dict[str, Any]], columns: Sequence[str],
                   cell: Callable[[Any], str] = lambda v: "-" if v is None else str(v)) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(cell(row[c]) for c in columns) + " |")
    return "\n".join(lines)


def write_json(path: Path, data: Any) -> None:
    """The `--json` output of a benchmark: indented, parent folders created, its path printed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}")


def bandwidth_probe() -> torch.Tensor:
    """1 GiB of fp32 ones on huge pages, as the engine's packed weights and KV cache are: on 4 KB
    pages every 4 KB read costs a TLB miss, and a probe there read ~30% slower than the engine's own
    memory can be read (Intel Xeon with AMX, 2 threads: 24.6 against 35 GB/s)."""
    import torch

    from nanovllm.cpu import huge_pages
    return huge_pages.empty(1 << 28, torch.float32).fill_(1.0)


def read_bandwidth(buf: torch.Tensor, repeats: int = 5) -> float:
    """Bytes per second `buf` (fp32, far larger than the caches; bandwidth_probe()) reads at with the
    engine's threads: the best of `repeats` runs of two reductions over it, a dot product and a sum.
    Either alone can be bound by its arithmetic rather than the memory (torch's fp32 sum reads at
    ~30 GB/s where its dot product reads at ~35 on the Intel Xeon with AMX), which made the floors
    built on it too long (decode steps at 120% of their floor)."""
    import torch

    best = float("inf")
    for _ in range(repeats):
        for read in (torch.sum, lambda b: torch.dot(b, b)):
            start = time.perf_counter()
            read(buf)
            best = min(best, time.perf_counter() - start)
    return buf.numel() * buf.element_size() / best


class CallClock:
    """Seconds spent in the wrapped calls, summed while `on`: each (owner, name) pair's attribute (an
    instance's method, or a class's for all its instances) replaced by a timed wrapper until
    restore() puts them back."""

    def __init__(self, calls: Iterable[tuple[Any, str]], on: bool = True) -> None:
        self.on, self.seconds = on, 0.0
        self._saved = [(owner, name, getattr(owner, name)) for owner, name in calls]
        for owner, name, fn in self._saved:
            setattr(owner, name, self._timed(fn))

    def restore(self) -> None:
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return wrapper
