"""Benchmark harnesses. `echo2.bench.netns`: a shaped virtual network (namespaces on a bridge, tc
TBF on both directions of every link) for the broadcast benchmark."""

from __future__ import annotations

from typing import Any

__all__ = ["Host", "NetnsError", "Shape", "ShapedNetwork"]


def __getattr__(name: str) -> Any:
    # lazy: importing the package does not build or import the network harness
    if name in __all__:
        from echo2.bench import netns

        return getattr(netns, name)
    raise AttributeError(f"module 'echo2.bench' has no attribute {name!r}")
