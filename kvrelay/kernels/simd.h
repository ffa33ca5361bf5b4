/* Vector helpers shared by the native kernels (the .c files beside it), which include this file; the
 * build key in kvrelay/kernels/native.py covers it.
 *
 * One source serves every target: `vf` is as wide as the widest float registers the compiler was
 * told it may use (-march=...), so each vector operation is one instruction there:
 *   AVX-512 (__AVX512F__)   16 lanes, 32 registers
 *   AVX / AVX2              8 lanes, 16 registers
 *   anything else           4 lanes (x86-64's baseline SSE2, NEON, ...), 16 or 32 registers
 * A vector wider than the registers would be split by the compiler into several (correct, but it
 * defeats register tiling, and an asm operand cannot name it at all), so nothing here assumes
 * a width: loops step by VLEN, and sizes a kernel needs (K % 16 in linear.c) are multiples of
 * every VLEN. */
#ifndef KVRELAY_SIMD_H
#define KVRELAY_SIMD_H

#include <stdint.h>

#if defined(__AVX512F__)
#define VLEN 16
#elif defined(__AVX__)
#define VLEN 8
#else
#define VLEN 4
#endif

#if defined(__AVX512F__) || defined(__aarch64__)
#define VREGS 32 /* vector registers the tiles may plan for */
#else
#define VREGS 16
#endif

typedef float vf __attribute__((vector_size(4 * VLEN), aligned(4)));
typedef int32_t vi __attribute__((vector_size(4 * VLEN), aligned(4)));
typedef float vf8 __attribute__((vector_size(32), aligned(4)));
typedef float vf4 __attribute__((vector_size(16), aligned(4)));

/* Which variant this library is, for kvrelay/kernels/native.py's start-up log: floats per vector. */
__attribute__((visibility("default"))) int kvrelay_vector_floats(void) { return VLEN; }

/* What decides the bits of a reduction here, for the compatibility digest of the batch-invariant
 * mode (kvrelay/worker/batch_invariance.py): the lanes each sum is spread over, and whether
 * `a += x * y` is one fused multiply-add (one rounding) or two operations. */
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
#define KVRELAY_FMA_NAME "fma"
#else
#define KVRELAY_FMA_NAME "no-fma"
#endif
#define KVRELAY_STRINGIFY2(x) #x
#define KVRELAY_STRINGIFY(x) KVRELAY_STRINGIFY2(x)
__attribute__((visibility("default"))) const char *kvrelay_simd_target(void) {
    return KVRELAY_STRINGIFY(VLEN) "-lane " KVRELAY_FMA_NAME;
}

/* Pins a vector to a register at this point: without it the compiler may fold the vector's load
 * into each arithmetic instruction that uses it (one load per use instead of one). */
#if defined(__x86_64__) || defined(__i386__)
#define KEEP_IN_REGISTER(v) __asm__("" : "+v"(v))
#elif defined(__aarch64__)
#define KEEP_IN_REGISTER(v) __asm__("" : "+w"(v))
#else
#define KEEP_IN_REGISTER(v) ((void)0)
#endif

/* Unaligned loads and stores through a may_alias type, as the compilers' own intrinsics do it (a
 * memcpy of 32 bytes is lowered to two 16-byte moves and a trip through the stack by some
 * -mtune settings, haswell's among them). */
typedef float vf_unaligned __attribute__((vector_size(4 * VLEN), aligned(4), may_alias));
typedef float vf4_unaligned __attribute__((vector_size(16), aligned(4), may_alias));
static inline vf load(const float *p) { return *(const vf_unaligned *)p; }
static inline void store(float *p, vf v) { *(vf_unaligned *)p = v; }
static inline vf splat(float x) { return (vf){0} + x; }
static inline vf4 load4(const float *p) { return *(const vf4_unaligned *)p; }
static inline void store4(float *p, vf4 v) { *(vf4_unaligned *)p = v; }

/* Reductions. sums4 gives the lane sums of four vectors as one 4-vector: halves of pairs of
 * vectors are added together, so the four reductions share their shuffles (with 16 lanes, 5 rounds
 * of shuffles and adds instead of 4 x 4). Shuffle indices count across both operands. */
#if VLEN == 16
static inline vf4 fold4(vf v) {  /* lanes i, i+4, i+8 and i+12 added */
    const vf8 h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
                + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    return __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
}
static inline vf4 sums4(vf a, vf b, vf c, vf d) {
    const vf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
                + __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    const vf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
                + __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    /* ab: 8 partial sums of a, then 8 of b; cd likewise. Now 4 of each of a, b, c, d: */
    const vf q = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
               + __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const vf8 h = __builtin_shufflevector(q, q, 0, 1, 4, 5, 8, 9, 12, 13)
                + __builtin_shufflevector(q, q, 2, 3, 6, 7, 10, 11, 14, 15);  /* 2 of each */
    return __builtin_shufflevector(h, h, 0, 2, 4, 6) + __builtin_shufflevector(h, h, 1, 3, 5, 7);
}
#elif VLEN == 8
static inline vf4 fold4(vf v) {
    return __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
}
static inline vf4 sums4(vf a, vf b, vf c, vf d) {
    const vf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11)
                + __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);  /* 4 of a, then 4 of b */
    const vf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11)
                + __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
    const vf h = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13)
               + __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);  /* 2 of each */
    return __builtin_shufflevector(h, h, 0, 2, 4, 6) + __builtin_shufflevector(h, h, 1, 3, 5, 7);
}
#else
static inline vf4 fold4(vf v) { return v; }
static inline vf4 sums4(vf a, vf b, vf c, vf d) {
    const vf ab = __builtin_shufflevector(a, b, 0, 1, 4, 5) + __builtin_shufflevector(a, b, 2, 3, 6, 7);
    const vf cd = __builtin_shufflevector(c, d, 0, 1, 4, 5) + __builtin_shufflevector(c, d, 2, 3, 6, 7);
    return __builtin_shufflevector(ab, cd, 0, 2, 4, 6) + __builtin_shufflevector(ab, cd, 1, 3, 5, 7);
}
#endif

/* Row sums of many vectors at once. A vector of "row partials" holds VLEN / L rows of L lanes
 * each, row r in lanes [r L, r L + L), its sum being the sum of those lanes. halve(x, y, L) adds
 * the two halves of every row of x and of y, giving x's rows then y's at L / 2 lanes each: VLEN
 * vectors (L = VLEN), halved pairwise log2(VLEN) levels deep, become one vector whose lane i is the
 * sum of vector i, in VLEN - 1 halvings (two shuffles and an add each) instead of VLEN hsums. L
 * must be a constant (it picks the shuffles), VLEN >= L >= 2. */
#define HALVES(x, y, ...) __builtin_shufflevector(x, y, __VA_ARGS__)
static inline vf halve(vf x, vf y, int lanes) {
#if VLEN == 16
    switch (lanes) {
        case 16: return HALVES(x, y, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
                      + HALVES(x, y, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
        case 8: return HALVES(x, y, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
                     + HALVES(x, y, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
        case 4: return HALVES(x, y, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29)
                     + HALVES(x, y, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
        default: return HALVES(x, y, 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30)
                      + HALVES(x, y, 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    }
#elif VLEN == 8
    switch (lanes) {
        case 8: return HALVES(x, y, 0, 1, 2, 3, 8, 9, 10, 11) + HALVES(x, y, 4, 5, 6, 7, 12, 13, 14, 15);
        case 4: return HALVES(x, y, 0, 1, 4, 5, 8, 9, 12, 13) + HALVES(x, y, 2, 3, 6, 7, 10, 11, 14, 15);
        default: return HALVES(x, y, 0, 2, 4, 6, 8, 10, 12, 14) + HALVES(x, y, 1, 3, 5, 7, 9, 11, 13, 15);
    }
#else
    switch (lanes) {
        case 4: return HALVES(x, y, 0, 1, 4, 5) + HALVES(x, y, 2, 3, 6, 7);
        default: return HALVES(x, y, 0, 2, 4, 6) + HALVES(x, y, 1, 3, 5, 7);
    }
#endif
}
#undef HALVES

/* Four vectors' row partials at VLEN / 4 lanes per row (rows a, b, c, d), then VLEN / 4 such
 * results (4 rows each) as one vector of VLEN row sums: together the halving tree above. */
static inline vf halve4(vf a, vf b, vf c, vf d) {
    return halve(halve(a, b, VLEN), halve(c, d, VLEN), VLEN / 2);
}
static inline vf join_quarters(const vf *quarters) {  /* VLEN / 4 vectors from halve4 */
#if VLEN == 16
    return halve(halve(quarters[0], quarters[1], 4), halve(quarters[2], quarters[3], 4), 2);
#elif VLEN == 8
    return halve(quarters[0], quarters[1], 2);
#else
    return quarters[0];
#endif
}

static inline float hsum(vf v) {  /* halves added pairwise (a scalar loop would be VLEN-1 serial adds) */
    const vf4 h4 = fold4(v);
    return (h4[0] + h4[2]) + (h4[1] + h4[3]);
}

/* Lane-wise choice and maximum (a bitwise select: C has no ?: on vectors). */
static inline vf vselect(vi take_a, vf a, vf b) { return (vf)(((vi)a & take_a) | ((vi)b & ~take_a)); }
static inline vf vmax(vf a, vf b) { return vselect(a > b, a, b); }

static inline float hmax(vf v) {  /* the largest lane: lanes swapped at halving distances */
#if VLEN == 16
    v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
#elif VLEN == 8
    v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3));
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6));
#else
    v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1));
    v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2));
#endif
    return v[0];
}

/* exp(x) for x <= 0 on every lane: x = k ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' degree-6
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
/* x * sigmoid(x) on every lane: sigmoid is 1 / (1 + e^-x) for x >= 0 and e^x / (1 + e^x) below,
 * so the exponential is always of -|x| and never overflows. */
static inline vf silu(vf x) {
    const vi negative = x < 0.0f;
    const vf e = exp_nonpositive((vf)((vi)x | ((vi){0} + INT32_MIN)));  /* e^-|x|: sign bit set */
    const vf numerator = (vf)(((vi)e & negative) | ((vi)splat(1.0f) & ~negative));
    return x * numerator / (1.0f + e);
}
static inline float silu1(float x) { return silu(splat(x))[0]; }

#endif
