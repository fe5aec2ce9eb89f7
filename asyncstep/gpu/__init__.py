"""Awaitables for CUDA events and ``torch.distributed`` Work; stream helpers;
later CUDA graphs and Triton kernels.

May import torch, triton, trio/anyio.
"""

from asyncstep.gpu.work import PendingWork, is_cuda, wait_cuda_event, wait_work

__all__ = ["PendingWork", "is_cuda", "wait_cuda_event", "wait_work"]
