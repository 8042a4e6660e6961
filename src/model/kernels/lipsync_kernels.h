// lipsync's own kernels: the planned path's epilogue (bias + residual + activation, the pixel
// shuffle of the upsampling forms, the write into a channel slice of a skip concatenation
// with the skip feature copied beside it, the output's sigmoid and NCHW write), the input
// conversion (NCHW to NHWC with zero channels up to the padded count) and the largest
// absolute value of a buffer (the half-precision overflow check).
//
// One source for both builds: nvcc compiles it to PTX for the GPU (build.rs, `cuda`
// feature) and the host C++ compiler compiles the same per-item functions for the CPU tests
// (host.cpp), which check them against candle's operations. Argument structs are plain C and
// mirrored by `#[repr(C)]` structs in src/model/kernels.rs.
#pragma once
#include <stdint.h>

#include <math.h>
#include <string.h>

#ifdef __CUDACC__
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define LS_HD __host__ __device__
#else
#define LS_HD
#endif

// Where one output phase of a layer reads its raw convolution output: buffer `ptr` of
// `h`×`w` pixels with `c` channels (NHWC, packed), this phase's channels from `base`, pixel
// (i, j) of the phase at (i + cy, j + cx).
typedef struct {
  uint64_t ptr;
  int32_t h, w, c, base, cy, cx;
} LsSrc;

enum { LS_ACT_NONE = 0, LS_ACT_RELU = 1, LS_ACT_SIGMOID = 2 };

typedef struct {
  // Phase p = (oy & 1) * 2 + (ox & 1) of an output pixel reads src[p] when `shuffle`, else
  // every pixel reads src[0] at its own position.
  LsSrc src[4];
  uint64_t bias;      // cout values, or 0: none
  uint64_t residual;  // (n, oh, ow, cout) packed, or 0: none; may be `dst` itself (in place)
  uint64_t skip;      // (n, oh, ow, skip_c) packed, copied beside the output, or 0
  uint64_t dst;       // NHWC with dst_c channels per pixel, or NCHW (n, cout, oh, ow)
  uint64_t amax;      // one int32: the largest |value| written (float bits), or 0: none
  int32_t n, oh, ow, cout, skip_c;
  int32_t dst_c;      // channels per pixel of dst (NHWC)
  int32_t dst_off;    // the layer's first channel in dst
  int32_t skip_off;   // the skip feature's first channel in dst
  int32_t shuffle;    // 1: phases interleaved (2h×2w output of h×w phases)
  int32_t act;        // LS_ACT_*; the checked value is taken before a sigmoid
  int32_t nchw_out;   // 1: dst is NCHW (the network's output)
  int32_t vec;        // channels per work item (1, or 16 bytes' worth); divides every count
} LsEpilogue;

typedef struct {
  uint64_t src;  // NCHW (n, c, h, w)
  uint64_t dst;  // NHWC (n, h, w, cpad), channels c.. zero
  int32_t n, c, h, w, cpad, unused;
} LsInput;

typedef struct {
  uint64_t src;
  uint64_t amax;  // one int32, as LsEpilogue's
  int64_t count;
} LsMaxAbs;

#ifdef __cplusplus
static_assert(sizeof(LsSrc) == 32, "LsSrc as src/model/kernels.rs has it");
static_assert(sizeof(LsEpilogue) == 216, "LsEpilogue as src/model/kernels.rs has it");
static_assert(sizeof(LsInput) == 40, "LsInput as src/model/kernels.rs has it");
static_assert(sizeof(LsMaxAbs) == 24, "LsMaxAbs as src/model/kernels.rs has it");
#endif

template <typename T> struct LsCvt;
template <> struct LsCvt<float> {
  static LS_HD inline float to(float v) { return v; }
  static LS_HD inline float from(float v) { return v; }
};
#ifdef __CUDACC__
template <> struct LsCvt<__half> {
  static LS_HD inline float to(__half v) { return __half2float(v); }
  static LS_HD inline __half from(float v) { return __float2half_rn(v); }
};
template <> struct LsCvt<__nv_bfloat16> {
  static LS_HD inline float to(__nv_bfloat16 v) { return __bfloat162float(v); }
  static LS_HD inline __nv_bfloat16 from(float v) { return __float2bfloat16_rn(v); }
};
#endif

// The bits of |v| as an int: non-negative floats order as their bits, NaN above infinity.
LS_HD inline int32_t ls_abs_bits(float v) {
#ifdef __CUDA_ARCH__
  return __float_as_int(fabsf(v));
#else
  float a = fabsf(v);
  int32_t bits;
  memcpy(&bits, &a, sizeof bits);
  return bits;
#endif
}

// VEC consecutive elements, with one 16-byte access on the GPU where they fill one.
#ifdef __CUDA_ARCH__
#define LS_WIDE(T, VEC) (VEC * sizeof(T) == 16)
typedef uint4 LsWord;
#else
#define LS_WIDE(T, VEC) false
typedef struct { uint32_t v[4]; } LsWord;
#endif

template <typename T, int VEC> LS_HD inline void ls_load(const T* p, T* out) {
  if (LS_WIDE(T, VEC)) {
    *reinterpret_cast<LsWord*>(out) = *reinterpret_cast<const LsWord*>(p);
  } else {
    for (int v = 0; v < VEC; v++) out[v] = p[v];
  }
}

template <typename T, int VEC> LS_HD inline void ls_store(T* p, const T* in) {
  if (LS_WIDE(T, VEC)) {
    *reinterpret_cast<LsWord*>(p) = *reinterpret_cast<const LsWord*>(in);
  } else {
    for (int v = 0; v < VEC; v++) p[v] = in[v];
  }
}

// Work item i of the epilogue: channels [c, c + VEC) of one output pixel (c counts the
// layer's cout channels, then the skip's). Returns the largest |value| computed, as bits
// (0 for a skip copy).
template <typename T, int VEC>
LS_HD inline int32_t ls_epilogue_item(const LsEpilogue& a, int64_t i) {
  const int groups = (a.cout + a.skip_c) / VEC;
  const int64_t pix = i / groups;
  const int c = (int)(i % groups) * VEC;
  const int ox = (int)(pix % a.ow);
  const int64_t rows = pix / a.ow;
  const int oy = (int)(rows % a.oh);
  const int64_t n = rows / a.oh;
  alignas(16) T buf[VEC];
  if (c >= a.cout) {
    const int cs = c - a.cout;
    ls_load<T, VEC>((const T*)a.skip + pix * a.skip_c + cs, buf);
    ls_store<T, VEC>((T*)a.dst + pix * a.dst_c + a.skip_off + cs, buf);
    return 0;
  }
  int p = 0, iy = oy, ix = ox;
  if (a.shuffle) {
    p = ((oy & 1) << 1) | (ox & 1);
    iy = oy >> 1;
    ix = ox >> 1;
  }
  const LsSrc s = a.src[p];
  const T* z = (const T*)s.ptr + ((n * s.h + iy + s.cy) * s.w + ix + s.cx) * s.c + s.base + c;
  ls_load<T, VEC>(z, buf);
  float f[VEC];
  for (int v = 0; v < VEC; v++) f[v] = LsCvt<T>::to(buf[v]);
  if (a.bias) {
    ls_load<T, VEC>((const T*)a.bias + c, buf);
    for (int v = 0; v < VEC; v++) f[v] += LsCvt<T>::to(buf[v]);
  }
  if (a.residual) {
    ls_load<T, VEC>((const T*)a.residual + pix * a.cout + c, buf);
    for (int v = 0; v < VEC; v++) f[v] += LsCvt<T>::to(buf[v]);
  }
  int32_t m = 0;
  for (int v = 0; v < VEC; v++) {
    // ReLU as cuDNN's with NOT_PROPAGATE_NAN: NaN gives 0.
    if (a.act == LS_ACT_RELU) f[v] = f[v] > 0.0f ? f[v] : 0.0f;
    int32_t b = ls_abs_bits(f[v]);
    m = b > m ? b : m;
    if (a.act == LS_ACT_SIGMOID) f[v] = 1.0f / (1.0f + expf(-f[v]));
    buf[v] = LsCvt<T>::from(f[v]);
  }
  if (a.nchw_out) {
    T* d = (T*)a.dst;
    for (int v = 0; v < VEC; v++)
      d[((n * a.cout + c + v) * a.oh + oy) * a.ow + ox] = buf[v];
  } else {
    ls_store<T, VEC>((T*)a.dst + pix * a.dst_c + a.dst_off + c, buf);
  }
  return m;
}

template <typename T> LS_HD inline int64_t ls_epilogue_items(const LsEpilogue& a, int vec) {
  return (int64_t)a.n * a.oh * a.ow * ((a.cout + a.skip_c) / vec);
}

// Element i of the input conversion (i over n·h·w·cpad, the NHWC output's order).
template <typename T> LS_HD inline void ls_input_item(const LsInput& a, int64_t i) {
  const int cp = (int)(i % a.cpad);
  const int64_t pix = i / a.cpad;
  const int x = (int)(pix % a.w);
  const int64_t rows = pix / a.w;
  const int y = (int)(rows % a.h);
  const int64_t n = rows / a.h;
  T* d = (T*)a.dst;
  d[i] = cp < a.c ? ((const T*)a.src)[((n * a.c + cp) * a.h + y) * a.w + x] : LsCvt<T>::from(0.0f);
}
