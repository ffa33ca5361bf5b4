/* Vector helpers shared by the native kernels (the .c files beside it), which include this file; the
 * build key in kvrelay/model/native.py covers it. */
#ifndef KVRELAY_SIMD_H
#define KVRELAY_SIMD_H

#include <stdint.h>
#include <string.h>

/* 16 floats, the unit of the vector code; GCC and Clang lower it to AVX-512, AVX2, NEON, ... */
typedef float vf __attribute__((vector_size(64), aligned(4)));
typedef float vf8 __attribute__((vector_size(32), aligned(4)));
typedef float vf4 __attribute__((vector_size(16), aligned(4)));
typedef int32_t vi __attribute__((vector_size(64), aligned(4)));

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }
static inline vf splat(float x) { return (vf){0} + x; }

static inline float hsum(vf v) {  /* halves added pairwise (a scalar loop would be 15 serial adds) */
    vf8 h8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
           + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    vf4 h4 = __builtin_shufflevector(h8, h8, 0, 1, 2, 3) + __builtin_shufflevector(h8, h8, 4, 5, 6, 7);
    return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

/* exp(x) for x <= 0 on 16 lanes: x = k ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' degree-6
 * polynomial (relative error ~1e-7), times 2^k built in the exponent bits. Below -87 the result is
 * clamped to exp(-87) ~ 1.6e-38, i.e. zero weight. */
static inline vf exp_nonpositive(vf x) {
    const vf floor_ = splat(-87.0f);
    const vi below = x < floor_;
    x = (vf)(((vi)floor_ & below) | ((vi)x & ~below));
    const vi ki = __builtin_convertvector(x * 1.44269504f - 0.5f, vi);  /* round to nearest (x <= 0) */
    const vf k = __builtin_convertvector(ki, vf);
    const vf r = x - k * 0.693359375f + k * 2.12194440e-4f;  /* x - k ln2, ln2 in two parts */
    vf p = r * 1.9875691500e-4f + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    return p * (vf)((ki + 127) << 23);  /* times 2^k */
}
static inline float exp1(float x) { return exp_nonpositive(splat(x))[0]; }
/* x * sigmoid(x) on 16 lanes: sigmoid is 1 / (1 + e^-x) for x >= 0 and e^x / (1 + e^x) below, so
 * the exponential is always of -|x| and never overflows. */
static inline vf silu(vf x) {
    const vi negative = x < 0.0f;
    const vf e = exp_nonpositive((vf)((vi)x | ((vi){0} + INT32_MIN)));  /* e^-|x|: sign bit set */
    const vf numerator = (vf)(((vi)e & negative) | ((vi)splat(1.0f) & ~negative));
    return x * numerator / (1.0f + e);
}
static inline float silu1(float x) { return silu(splat(x))[0]; }

static inline vf4 load4(const float *p) { vf4 v; memcpy(&v, p, sizeof v); return v; }
static inline void store4(float *p, vf4 v) { memcpy(p, &v, sizeof v); }

#endif
