"""kvevict: KV-cache eviction policies over tensors you own.

Tensors (torch, numpy, anything with ``__dlpack__``) are read and compacted where they are:
kvevict builds views over their memory from their shapes and strides and copies nothing.
"""
from ._kvevict import Compressor, Report, __version__, active_cpu_isa, evict, observation_scores, select

__all__ = ["Compressor", "Report", "__version__", "active_cpu_isa", "evict", "observation_scores", "select"]
