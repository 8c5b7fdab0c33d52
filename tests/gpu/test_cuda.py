"""The CUDA code paths, on a machine with a GPU (skipped elsewhere).

The checks live in ``tests/gpu/gpu_check.py`` so they can also be run by hand; here
they run under pytest wherever CUDA is available: pack / unpack of CUDA trees, CPU trees
staged onto the GPU through pinned memory, and gloo ranks sharing the GPU whose receivers
run under ``torch.cuda.set_sync_debug_mode("error")`` (no host-device sync).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")



def _assert_all_pass(results: list[tuple[str, bool, str]]) -> None:
    failed = [f"{name}\n{err}" for name, ok, err in results if not ok]
    assert not failed, "\n".join(failed)


def test_single_process_cuda_paths() -> None:
    import gpu_check

    _assert_all_pass(gpu_check.single_process())


def test_gloo_ranks_sharing_the_gpu_receive_without_syncing() -> None:
    import gpu_check

    _assert_all_pass(gpu_check.shared_gpu(2))


def test_nccl_group_of_one_runs_the_source_side() -> None:
    import gpu_check

    _assert_all_pass(gpu_check.nccl_single_rank())
