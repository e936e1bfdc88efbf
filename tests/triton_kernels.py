"""A Triton kernel for the storage sanitizer's launch check (Triton reads a kernel's source
from its file, so it cannot be defined in a test's exec'd code)."""

import triton
import triton.language as tl


@triton.jit
def add_one(x_ptr, n: tl.constexpr):
    i = tl.arange(0, n)
    tl.store(x_ptr + i, tl.load(x_ptr + i) + 1)
