"""The checks that the compile test runs on TileLang's generated CUDA source, on hand-written sources: what they
must find and what they must let pass."""
from flashgdn.kernels.hopper.common import barriers_in_thread_branches

WARP_BRANCH = """\
extern "C" __global__ void k(float* x) {
  __syncthreads();
  if (((((int)threadIdx.x) & 63) >> 5) == 1) {
    for (int i = 0; i < 2; ++i) {
      x[i] = 0.0f;
    }
    __syncthreads();
    x[2] = 1.0f;
  }
  __syncthreads();
}
"""

ELSE_BRANCH = """\
extern "C" __global__ void k(float* x, int n) {
  if (((int)threadIdx.x) < 64) {
    x[0] = 1.0f;
  } else {
    x[1] = 2.0f;
    __syncthreads();
  }
}
"""

UNIFORM = """\
extern "C" __global__ void k(float* x, int n) {
  if (0 < n) {
    __syncthreads();
    if (((int)threadIdx.x) < 64) {
      x[0] = 1.0f;
    }
    __syncthreads();
  } else {
    __syncthreads();
  }
  for (int i = 0; i < n; ++i) {
    if (((int)threadIdx.x) == i) {
      x[i] = 0.0f;
    }
    __syncthreads();
  }
}
"""


def test_a_barrier_inside_a_branch_on_the_thread_index_is_found():
    assert barriers_in_thread_branches(WARP_BRANCH) == [(7, "if (((((int)threadIdx.x) & 63) >> 5) == 1) {")]


def test_a_barrier_in_the_else_of_such_a_branch_is_found():
    assert barriers_in_thread_branches(ELSE_BRANCH) == [(6, "if (((int)threadIdx.x) < 64) {")]


def test_barriers_in_uniform_branches_and_loops_and_after_thread_branches_pass():
    assert barriers_in_thread_branches(UNIFORM) == []
