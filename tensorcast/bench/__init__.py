"""``python -m tensorcast.bench``: measure tensorcast against the peers' ways on your cluster.

The layer above the library: it imports ``tensorcast`` and nothing in ``tensorcast``
imports it. The repository's development benchmarks (``benchmarks/``) share its
workloads and baselines from here, so each exists once.

- ``workloads``: the built-in batches (audio, many small tensors, tiny, a GPT batch).
- ``batches``: a user's batch (a file, or ``module:function``), and the checks.
- ``baselines``: the peers' ways (NeMo's pickled packet, ``broadcast_object_list``,
  one broadcast per tensor) and the floor.
- ``timing``: the methods and their interleaved timing (CUDA events on GPUs).
- ``report``: rows, tables, the chart, the progress bar.
- ``run``: the default group from the launcher's environment, the mesh's slots.
"""

from __future__ import annotations

from tensorcast.bench.batches import load_batch, save_batch

__all__ = ["load_batch", "save_batch"]
