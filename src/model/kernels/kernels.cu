// The GPU entry points of lipsync's own kernels (see lipsync_kernels.h), compiled to PTX by
// build.rs with the `cuda` feature and launched by src/model/cudnn/net.rs. Grid-stride loops
// over the work items; launch any grid.
#include "lipsync_kernels.h"

// The largest |value| of a thread reduced over its warp, one atomic per warp.
__device__ inline void ls_warp_max(uint64_t amax, int32_t m) {
  if (!amax) return;
  for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0 && m > 0) atomicMax((int*)amax, m);
}

template <typename T, int VEC> __device__ void ls_epilogue(const LsEpilogue& a, int64_t items) {
  int32_t m = 0;
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < items; i += step) {
    int32_t b = ls_epilogue_item<T, VEC>(a, i);
    m = b > m ? b : m;
  }
  ls_warp_max(a.amax, m);
}

template <typename T> __device__ void ls_input(const LsInput& a, int64_t items) {
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < items; i += step)
    ls_input_item<T>(a, i);
}

template <typename T> __device__ void ls_max_abs(const LsMaxAbs& a) {
  int32_t m = 0;
  const int64_t step = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < a.count; i += step) {
    int32_t b = ls_abs_bits(LsCvt<T>::to(((const T*)a.src)[i]));
    m = b > m ? b : m;
  }
  ls_warp_max(a.amax, m);
}

#define LS_TYPES(X) X(f32, float, 4) X(f16, __half, 8) X(bf16, __nv_bfloat16, 8)

#define LS_ENTRY(name, T, WIDE)                                                              \
  extern "C" __global__ void lipsync_epilogue_##name##_v1(LsEpilogue a, int64_t items) {     \
    ls_epilogue<T, 1>(a, items);                                                             \
  }                                                                                          \
  extern "C" __global__ void lipsync_epilogue_##name##_wide(LsEpilogue a, int64_t items) {   \
    ls_epilogue<T, WIDE>(a, items);                                                          \
  }                                                                                          \
  extern "C" __global__ void lipsync_input_##name(LsInput a, int64_t items) {                \
    ls_input<T>(a, items);                                                                   \
  }                                                                                          \
  extern "C" __global__ void lipsync_max_abs_##name(LsMaxAbs a) { ls_max_abs<T>(a); }

LS_TYPES(LS_ENTRY)
