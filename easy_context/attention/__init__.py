"""Attention kernels returning (out, lse), their merge, packed documents, and the float64
reference (single-device attention itself is the ``local`` method, easy_context.parallel.local)."""

from .contract import Kernel, default_scale
from .kernels import KERNELS
from .selection import available_kernels, select_kernel
from .merge import merge, merge_into
from .reference import reference_attention

__all__ = ["KERNELS", "Kernel", "available_kernels", "default_scale", "select_kernel",
           "reference_attention", "merge", "merge_into"]
