/* The small per-layer operations between the matmuls, for the CPU, float32: residual add with
 * RMSNorm, SiLU-and-multiply, rotary embedding in place, and the KV cache write.
 *
 * Compiled on first use by kvrelay/kernels/native.py and called through ctypes; the callers in
 * kvrelay/model/layers.py and attention.py use torch when it is unavailable. Each of these is a
 * few microseconds of arithmetic on a decode batch, but in torch it is 2-6 operator calls of
 * ~5-40 us each (dispatch, an OpenMP fork, a temporary); over 30 layers that was ~10% of a
 * batch-64 decode step. Work is split over threads only when there is enough of it.
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define PARALLEL_MIN_FLOATS (1 << 16) /* below this, one thread: forking costs more than it saves */

/* residual[m] += h[m] (when h is not NULL), then out[m] = residual[m] / rms(residual[m]) * weight,
 * for M rows of D floats, all contiguous. out may be h (each row of h is read before it is
 * written). */
void add_rms_norm_f32(const float *h, float *residual, const float *weight, float *out, int64_t M,
                      int64_t D, float eps, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (M * D >= PARALLEL_MIN_FLOATS)
    for (int64_t m = 0; m < M; m++) {
        float *r = residual + m * D, *o = out + m * D;
        float sum = 0.0f;
        if (h) {
            const float *x = h + m * D;
#pragma omp simd reduction(+ : sum)
            for (int64_t d = 0; d < D; d++) {
                const float v = r[d] + x[d];
                r[d] = v;
                sum += v * v;
            }
        } else {
#pragma omp simd reduction(+ : sum)
            for (int64_t d = 0; d < D; d++) sum += r[d] * r[d];
        }
        const float inv = 1.0f / __builtin_sqrtf(sum / (float)D + eps);
#pragma omp simd
        for (int64_t d = 0; d < D; d++) o[d] = r[d] * inv * weight[d];
    }
}

/* out[m, i] = silu(gate_up[m, i]) * gate_up[m, I + i]: gate_up [M, 2I] contiguous, out [M, I]. */
void silu_mul_f32(const float *gate_up, float *out, int64_t M, int64_t I, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (M * I >= PARALLEL_MIN_FLOATS)
    for (int64_t m = 0; m < M; m++) {
        const float *g = gate_up + m * 2 * I, *u = g + I;
        float *o = out + m * I;
        int64_t i = 0;
        for (; i + VLEN <= I; i += VLEN) store(o + i, silu(load(g + i)) * load(u + i));
        for (; i < I; i++) o[i] = silu1(g[i]) * u[i];
    }
}

/* Rotate-half rotary embedding, in place: for each of T tokens, n_heads heads of D floats
 * (x + t * ldx + head * D), x = x * cos + swap_halves(x) * sin, with cos and sin [T, D] as
 * kvrelay/model/layers.py's RotaryEmbedding.cos_sin makes them (sin negated on the first half). */
void rotary_f32(float *x, int64_t ldx, const float *cos, const float *sin, int64_t T, int64_t n_heads,
                int64_t D, int num_threads) {
    const int64_t half = D / 2;
#pragma omp parallel for num_threads(num_threads) if (T * n_heads * D >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cos + t * D, *s = sin + t * D;
        for (int64_t h = 0; h < n_heads; h++) {
            float *a = x + t * ldx + h * D, *b = a + half;
#pragma omp simd
            for (int64_t d = 0; d < half; d++) {
                const float lo = a[d], hi = b[d];
                a[d] = lo * c[d] + hi * s[d];
                b[d] = hi * c[half + d] + lo * s[half + d];
            }
        }
    }
}

/* Writes T tokens' K and V rows into the paged cache [num_blocks, 2, Hkv, bs, D]: token t goes to
 * block slots[t] / bs, offset slots[t] % bs. k and v rows are ldk / ldv floats apart, heads
 * contiguous within a row. The caller has checked every slot lies inside the cache. */
void write_kv_f32(const float *k, int64_t ldk, const float *v, int64_t ldv, float *cache,
                  const int64_t *slots, int64_t T, int64_t Hkv, int64_t bs, int64_t D) {
    const int64_t slice = bs * D, block = 2 * Hkv * slice;
    for (int64_t t = 0; t < T; t++) {
        float *dst = cache + slots[t] / bs * block + slots[t] % bs * D;
        for (int64_t h = 0; h < Hkv; h++) {
            memcpy(dst + h * slice, k + t * ldk + h * D, D * sizeof(float));
            memcpy(dst + (Hkv + h) * slice, v + t * ldv + h * D, D * sizeof(float));
        }
    }
}
