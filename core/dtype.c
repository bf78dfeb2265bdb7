/*
 * dtype.c - dtype names, sizes, parsing and promotion, and the host-side
 * element access of the CPU reference (moe_load_* / moe_store_*).
 *
 * Conversions, defined for every value:
 *   float -> integer truncates toward zero and saturates at the target's
 *   range; NaN becomes 0. float -> bool and integer -> bool are v != 0
 *   (NaN is true). integer -> narrower integer wraps (two's complement).
 *   double -> bf16/f16 goes through float (round to nearest even twice).
 */
#include <math.h>
#include <string.h>

#include "internal.h"

typedef struct moe_dtype_info {
  const char *name;
  size_t size;
  const char *aliases[3];
} moe_dtype_info;

static const moe_dtype_info moe_dtypes[] = {
    [MOE_F32] = {"f32", 4, {"float32", "float", NULL}},
    [MOE_F64] = {"f64", 8, {"float64", "double", NULL}},
    [MOE_BF16] = {"bf16", 2, {"bfloat16", NULL, NULL}},
    [MOE_F16] = {"f16", 2, {"float16", "half", NULL}},
    [MOE_I8] = {"i8", 1, {"int8", NULL, NULL}},
    [MOE_U8] = {"u8", 1, {"uint8", "byte", NULL}},
    [MOE_I32] = {"i32", 4, {"int32", "int", NULL}},
    [MOE_I64] = {"i64", 8, {"int64", "long", NULL}},
    [MOE_BOOL] = {"bool", 1, {NULL, NULL, NULL}},
};
_Static_assert(sizeof(moe_dtypes) / sizeof(moe_dtypes[0]) == MOE_DTYPE_COUNT,
               "moe_dtypes must describe every moe_dtype");

static bool moe_dtype_valid(moe_dtype dt) { return (int)dt >= 0 && dt < MOE_DTYPE_COUNT; }

const char *moe_dtype_name(moe_dtype dt) {
  return moe_dtype_valid(dt) ? moe_dtypes[dt].name : "dtype?";
}

size_t moe_dtype_size(moe_dtype dt) { return moe_dtype_valid(dt) ? moe_dtypes[dt].size : 0; }

bool moe_dtype_is_float(moe_dtype dt) {
  return dt == MOE_F32 || dt == MOE_F64 || dt == MOE_BF16 || dt == MOE_F16;
}

bool moe_dtype_parse(const char *name, moe_dtype *out) {
  if (!name || !out) return false;
  for (int i = 0; i < MOE_DTYPE_COUNT; i++) {
    bool hit = strcmp(name, moe_dtypes[i].name) == 0;
    for (int k = 0; k < 3 && !hit && moe_dtypes[i].aliases[k]; k++)
      hit = strcmp(name, moe_dtypes[i].aliases[k]) == 0;
    if (hit) {
      *out = (moe_dtype)i;
      return true;
    }
  }
  return false;
}

/* bool < integers < floats */
static int moe_dtype_kind(moe_dtype dt) {
  if (dt == MOE_BOOL) return 0;
  return moe_dtype_is_float(dt) ? 2 : 1;
}

moe_dtype moe_dtype_promote(moe_dtype a, moe_dtype b) {
  if (a == b) return a;
  int ka = moe_dtype_kind(a), kb = moe_dtype_kind(b);
  if (ka != kb) return ka > kb ? a : b;
  if (ka == 2) { /* floats: bf16 with f16 meet at f32 */
    if ((a == MOE_BF16 && b == MOE_F16) || (a == MOE_F16 && b == MOE_BF16)) return MOE_F32;
    return moe_dtypes[a].size >= moe_dtypes[b].size ? a : b;
  }
  /* integers: i8 with u8 has no 16-bit home here, so i32 */
  if ((a == MOE_I8 && b == MOE_U8) || (a == MOE_U8 && b == MOE_I8)) return MOE_I32;
  return moe_dtypes[a].size >= moe_dtypes[b].size ? a : b;
}

/* ------------------------------------------------------- element access */

static int64_t moe_f64_to_i64_sat(double v, int64_t lo, int64_t hi) {
  if (v != v) return 0;
  /* lo is -2^k and hi is 2^k - 1: both bounds are exact doubles */
  if (v <= (double)lo) return lo;
  if (v >= -(double)lo) return hi;
  return (int64_t)v; /* truncates toward zero */
}

double moe_load_f64(const void *p, moe_dtype dt) {
  switch (dt) {
    case MOE_F32: { float v; memcpy(&v, p, 4); return v; }
    case MOE_F64: { double v; memcpy(&v, p, 8); return v; }
    case MOE_BF16: { moe_bf16 h; memcpy(&h, p, 2); return moe_bf16_to_f32(h); }
    case MOE_F16: { moe_f16 h; memcpy(&h, p, 2); return moe_f16_to_f32(h); }
    case MOE_I8: return *(const int8_t *)p;
    case MOE_U8: return *(const uint8_t *)p;
    case MOE_I32: { int32_t v; memcpy(&v, p, 4); return v; }
    case MOE_I64: { int64_t v; memcpy(&v, p, 8); return (double)v; }
    case MOE_BOOL: return *(const uint8_t *)p ? 1.0 : 0.0;
    default: break;
  }
  MOE_ASSERT(!"moe_load_f64: bad dtype");
  return 0;
}

int64_t moe_load_i64(const void *p, moe_dtype dt) {
  switch (dt) {
    case MOE_I8: return *(const int8_t *)p;
    case MOE_U8: return *(const uint8_t *)p;
    case MOE_I32: { int32_t v; memcpy(&v, p, 4); return v; }
    case MOE_I64: { int64_t v; memcpy(&v, p, 8); return v; }
    case MOE_BOOL: return *(const uint8_t *)p ? 1 : 0;
    case MOE_F32: case MOE_F64: case MOE_BF16: case MOE_F16:
      return moe_f64_to_i64_sat(moe_load_f64(p, dt), INT64_MIN, INT64_MAX);
    default: break;
  }
  MOE_ASSERT(!"moe_load_i64: bad dtype");
  return 0;
}

void moe_store_f64(void *p, moe_dtype dt, double v) {
  switch (dt) {
    case MOE_F32: { float f = (float)v; memcpy(p, &f, 4); return; }
    case MOE_F64: memcpy(p, &v, 8); return;
    case MOE_BF16: { moe_bf16 h = moe_f32_to_bf16((float)v); memcpy(p, &h, 2); return; }
    case MOE_F16: { moe_f16 h = moe_f32_to_f16((float)v); memcpy(p, &h, 2); return; }
    case MOE_I8: *(int8_t *)p = (int8_t)moe_f64_to_i64_sat(v, INT8_MIN, INT8_MAX); return;
    case MOE_U8: { /* [0, 255]: saturate by hand, lo = 0 does not give 2^8 */
      uint8_t u = v != v || v <= 0 ? 0 : v >= 255.0 ? 255 : (uint8_t)v;
      *(uint8_t *)p = u;
      return;
    }
    case MOE_I32: {
      int32_t i = (int32_t)moe_f64_to_i64_sat(v, INT32_MIN, INT32_MAX);
      memcpy(p, &i, 4);
      return;
    }
    case MOE_I64: {
      int64_t i = moe_f64_to_i64_sat(v, INT64_MIN, INT64_MAX);
      memcpy(p, &i, 8);
      return;
    }
    case MOE_BOOL: *(uint8_t *)p = v != 0; return;
    default: break;
  }
  MOE_ASSERT(!"moe_store_f64: bad dtype");
}

void moe_store_i64(void *p, moe_dtype dt, int64_t v) {
  switch (dt) {
    case MOE_I8: *(int8_t *)p = (int8_t)v; return;
    case MOE_U8: *(uint8_t *)p = (uint8_t)v; return;
    case MOE_I32: { int32_t i = (int32_t)v; memcpy(p, &i, 4); return; }
    case MOE_I64: memcpy(p, &v, 8); return;
    case MOE_BOOL: *(uint8_t *)p = v != 0; return;
    case MOE_F32: { float f = (float)v; memcpy(p, &f, 4); return; }
    case MOE_F64: { double d = (double)v; memcpy(p, &d, 8); return; }
    case MOE_BF16: { moe_bf16 h = moe_f32_to_bf16((float)v); memcpy(p, &h, 2); return; }
    case MOE_F16: { moe_f16 h = moe_f32_to_f16((float)v); memcpy(p, &h, 2); return; }
    default: break;
  }
  MOE_ASSERT(!"moe_store_i64: bad dtype");
}
