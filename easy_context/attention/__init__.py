"""Attention kernels returning (out, lse), their merge, and single-device attention."""

from .kernels import KERNELS, Kernel, default_scale, select_kernel
from .local import local_attention, reference_attention
from .merge import merge, merge_into

__all__ = ["KERNELS", "Kernel", "default_scale", "select_kernel", "local_attention",
           "reference_attention", "merge", "merge_into"]
