// The host build of lipsync's own kernels (see lipsync_kernels.h): the same per-item code
// the GPU runs, in f32, for the CPU tests (src/model/kernels.rs) to check against candle's
// operations. build.rs compiles it into every build; only tests call it.
#include "lipsync_kernels.h"

static void ls_take_max(uint64_t amax, int32_t m) {
  if (amax && m > *(int32_t*)amax) *(int32_t*)amax = m;
}

// vec: 1, or 4 (16 bytes of f32): the GPU's two instantiations.
extern "C" int lipsync_host_epilogue_f32(const LsEpilogue* a) {
  int32_t m = 0;
  if (a->vec == 1) {
    int64_t items = ls_epilogue_items<float>(*a, 1);
    for (int64_t i = 0; i < items; i++) {
      int32_t b = ls_epilogue_item<float, 1>(*a, i);
      m = b > m ? b : m;
    }
  } else if (a->vec == 4) {
    int64_t items = ls_epilogue_items<float>(*a, 4);
    for (int64_t i = 0; i < items; i++) {
      int32_t b = ls_epilogue_item<float, 4>(*a, i);
      m = b > m ? b : m;
    }
  } else {
    return -1;
  }
  ls_take_max(a->amax, m);
  return 0;
}

extern "C" void lipsync_host_input_f32(const LsInput* a) {
  int64_t items = (int64_t)a->n * a->h * a->w * a->cpad;
  for (int64_t i = 0; i < items; i++) ls_input_item<float>(*a, i);
}

extern "C" void lipsync_host_max_abs_f32(const LsMaxAbs* a) {
  int32_t m = 0;
  for (int64_t i = 0; i < a->count; i++) {
    int32_t b = ls_abs_bits(((const float*)a->src)[i]);
    m = b > m ? b : m;
  }
  ls_take_max(a->amax, m);
}
