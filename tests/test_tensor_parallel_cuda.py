"""The tensor-parallel split on GPUs: two ranks give each the embedding of
one process on one GPU, bit for bit, eager, prefetched, compiled and (NCCL)
replayed in a captured CUDA graph, and each rank's device and host tiers
serve its own rows (tensor_parallel_cases.py runs and checks the ranks).

- Two GPUs, one process each, NCCL: the split as it is served.  The graph
  captures the gathers with NCCL's all-reduces.
- One GPU shared by two processes, gloo (all_reduce of CUDA tensors through
  the host): NCCL refuses two ranks on one GPU, and gloo's collectives run
  on the host, so no CUDA graph can capture them; both device tiers live on
  the one GPU, each serving its own rank's rows.

Skipped without the GPUs.  NVLink multicast (NVLS) stays off: the workers'
environment says NCCL_NVLS_ENABLE=0, and nothing turns it on.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tensor_parallel_cases import assert_same_values, check_ranks, run_two_ranks, write_tables

# Each rank compiles the layers (inductor, Triton) before its graph.
WORKER_TIMEOUT_S = 600
WORKER_ENV = {**os.environ, "NCCL_NVLS_ENABLE": "0"}

needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
    reason="needs two CUDA GPUs and NCCL")
needs_a_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    return write_tables(tmp_path_factory.mktemp("tp_cuda"))


@needs_two_gpus
def test_two_gpus_over_nccl_give_the_embedding_of_one_gpu(tables, tmp_path):
    run_two_ranks(tables, tmp_path, "nccl", "own-gpu", WORKER_TIMEOUT_S, WORKER_ENV)
    check_ranks(tables, tmp_path, 2, "own-gpu", graph=True)


@needs_a_gpu
def test_two_ranks_sharing_one_gpu_over_gloo_give_the_embedding_of_one(tables, tmp_path):
    run_two_ranks(tables, tmp_path, "gloo", "shared-gpu", WORKER_TIMEOUT_S, WORKER_ENV)
    # Values, not bits: on the H200 machine (torch 2.11), gloo's all-reduce of
    # CUDA tensors returned +0.0 where the ranks' rows were -0.0 and -0.0
    # (whose sum is -0.0); over CPU tensors and over NCCL the bits are checked.
    check_ranks(tables, tmp_path, 2, "shared-gpu", graph=False, same=assert_same_values)
