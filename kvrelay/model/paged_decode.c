/* Paged decode attention for the CPU, float32: one query token per sequence, reading each
 * sequence's K/V blocks where they lie in the paged cache (no gather into a padded copy).
 *
 * Compiled on first use by kvrelay/model/native.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes; kvrelay/model/attention.py falls back to plain torch when it is unavailable.
 *
 * Layout (kvrelay/model/attention.py): kv [num_blocks, 2, num_kv_heads, block_size, head_dim],
 * K at index 0 and V at 1. A query head h reads KV head h / group (grouped-query attention).
 *
 * Work item = (sequence, KV head): its `group` query heads share every K/V row it loads, so each
 * row is read from memory once. Per item, two passes over the context: scores (q . k * scale) into a
 * per-thread buffer and their maximum, then exp, sum and the weighted sum of V rows.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>

#define MAX_GROUP 64 /* query heads per KV head; the caller checks */

/* exp(x) for x <= 0, in a form the compiler vectorizes (libm's expf is a scalar call): x = k ln2 + r
 * with |r| <= ln2 / 2, exp(r) by Cephes' degree-6 polynomial (relative error ~1e-7), times 2^k built
 * in the exponent bits. Below -87 the result is clamped to exp(-87) ~ 1.6e-38, i.e. zero weight. */
static inline float exp_nonpositive(float x) {
    x = fmaxf(x, -87.0f);
    const float k = (float)(int)(x * 1.44269504f - 0.5f);  /* round to nearest (x <= 0) */
    const float r = x - k * 0.693359375f + k * 2.12194440e-4f;  /* x - k ln2, ln2 in two parts */
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const union { int32_t bits; float value; } two_k = {.bits = ((int32_t)k + 127) << 23};  /* 2^k */
    return p * two_k.value;
}

/* Ask for one row of a block that will be read soon. Blocks lie anywhere in the cache and the
 * hardware prefetcher does not guess the next one; asking for a whole block at once stalls on the
 * queue of outstanding misses, so the next block is requested one row per row read now. */
static inline void prefetch_row(const float *row, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 64 / sizeof(float)) __builtin_prefetch(row + i);
}

static inline float dot(int64_t n, const float *restrict x, const float *restrict y) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = 0; i < n; i++) sum += x[i] * y[i];
    return sum;
}

static inline void axpy(int64_t n, float a, const float *restrict x, float *restrict y) {  /* y += a x */
#pragma omp simd
    for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

/* One (sequence, KV head) work item; `head_dim` is a compile-time constant in the common cases
 * (see the dispatch below), so the dot products and row updates unroll into straight vector code. */
static inline void attend(
    const float *q, int64_t q_row_stride, const float *kv, const int64_t *block_tables,
    const int64_t *seq_lens, float *out, float *scores, int64_t s, int64_t h, int64_t num_heads,
    int64_t num_kv_heads, const int64_t head_dim, int64_t block_size, int64_t max_blocks, float scale)
{
    const int64_t group = num_heads / num_kv_heads;
    const int64_t head_stride = block_size * head_dim;   /* floats per (block, K or V, head) slice */
    const int64_t block_stride = 2 * num_kv_heads * head_stride;
    const int64_t max_context = max_blocks * block_size;
    const int64_t len = seq_lens[s];
    const int64_t *table = block_tables + s * max_blocks;
    const float *qh = q + s * q_row_stride + h * group * head_dim;  /* [group, head_dim] */
    float *oh = out + (s * num_heads + h * group) * head_dim;      /* [group, head_dim] */

    for (int64_t b = 0, t = 0; t < len; b++) {  /* pass 1: scores[g][t] = q_g . k_t * scale */
        const float *k = kv + table[b] * block_stride + h * head_stride;  /* [block_size, D] */
        const float *next = kv + table[b + 1 < max_blocks ? b + 1 : b] * block_stride + h * head_stride;
        for (int64_t i = 0; i < block_size && t < len; i++, t++, k += head_dim) {
            prefetch_row(next + i * head_dim, head_dim);
            for (int64_t g = 0; g < group; g++)
                scores[g * max_context + t] = dot(head_dim, qh + g * head_dim, k) * scale;
        }
    }
    float total[MAX_GROUP];
    for (int64_t g = 0; g < group; g++) {  /* softmax numerators, in place */
        float *sg = scores + g * max_context, top = sg[0], sum = 0.0f;
#pragma omp simd reduction(max : top)
        for (int64_t t = 1; t < len; t++) top = sg[t] > top ? sg[t] : top;
#pragma omp simd
        for (int64_t t = 0; t < len; t++) sg[t] = exp_nonpositive(sg[t] - top);
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; t++) sum += sg[t];
        total[g] = sum;
    }
    for (int64_t i = 0; i < group * head_dim; i++) oh[i] = 0.0f;
    for (int64_t b = 0, t = 0; t < len; b++) {  /* pass 2: out_g = sum_t p[g][t] v_t */
        const float *v = kv + table[b] * block_stride + (num_kv_heads + h) * head_stride;
        const float *next = kv + table[b + 1 < max_blocks ? b + 1 : b] * block_stride
                            + (num_kv_heads + h) * head_stride;
        for (int64_t i = 0; i < block_size && t < len; i++, t++, v += head_dim) {
            prefetch_row(next + i * head_dim, head_dim);
            for (int64_t g = 0; g < group; g++)
                axpy(head_dim, scores[g * max_context + t], v, oh + g * head_dim);
        }
    }
    for (int64_t g = 0; g < group; g++) {
        const float inv = 1.0f / total[g];
        float *og = oh + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; d++) og[d] *= inv;
    }
}

void paged_decode_f32(
    const float *q,               /* [num_seqs, num_heads, head_dim], rows q_row_stride apart */
    int64_t q_row_stride,         /* floats between two sequences' queries */
    const float *kv,              /* [num_blocks, 2, num_kv_heads, block_size, head_dim] */
    const int64_t *block_tables,  /* [num_seqs, max_blocks], row-major */
    const int64_t *seq_lens,      /* [num_seqs], tokens of context, >= 1 */
    float *out,                   /* [num_seqs, num_heads, head_dim], contiguous */
    float *scratch,               /* [num_threads, group, max_blocks * block_size] */
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks, float scale, int num_threads)
{
    const int64_t scratch_per_thread = num_heads / num_kv_heads * max_blocks * block_size;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = scratch + omp_get_thread_num() * scratch_per_thread;  /* [group, context] */
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * num_kv_heads; item++) {
            const int64_t s = item / num_kv_heads, h = item % num_kv_heads;
#define ATTEND(D) attend(q, q_row_stride, kv, block_tables, seq_lens, out, scores, s, h, num_heads, \
                         num_kv_heads, D, block_size, max_blocks, scale)
            switch (head_dim) {
                case 64: ATTEND(64); break;
                case 128: ATTEND(128); break;
                default: ATTEND(head_dim);
            }
#undef ATTEND
        }
    }
}
