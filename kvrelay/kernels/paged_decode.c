/* Paged decode attention for the CPU: one query token per sequence (float32), reading each
 * sequence's K/V blocks where they lie in the paged cache (no gather into a padded copy), stored as
 * float32, bfloat16, float16 or fp8 (e4m3 / e5m2, with per-head K and V scales).
 *
 * Compiled on first use by kvrelay/kernels/native.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes; kvrelay/attention/layer.py falls back to plain torch when it is unavailable.
 *
 * Layout (kvrelay/attention/layer.py): kv [num_blocks, 2, num_kv_heads, block_size, head_dim],
 * K at index 0 and V at 1. A query head h reads KV head h / group (grouped-query attention).
 *
 * One pass over the context with an online softmax: per block, the scores of every query head of
 * the work item (reading the block's K rows), then a running maximum and sum, then the weighted V
 * rows. A block is read front to back, K of every head then V of every head, the order it lies in
 * memory: reading 4 KB head slices scattered over the cache instead ran at 2/3 of the bandwidth.
 * Work item = a sequence, or (sequence, KV head) when there are too few sequences to keep every
 * thread busy.
 *
 * The query heads of a KV head (its GQA group) go through a block together: each K and V row is
 * loaded and widened once for all of them (score_rows, weighted_rows), so widening bf16, fp16 or
 * fp8 costs once per element, not once per query head; and a block's scores are summed
 * horizontally VLEN rows at a time (simd.h's halve), not row by row. The next block's rows are
 * asked for while this block's are read (prefetch_bytes), so memory and compute overlap: with both
 * (batch 64 x 264 tokens, SmolLM2-135M, 1 thread) bf16 takes 0.60 of float32's time, which the
 * earlier kernel (every row read per query head) took 0.97 of.
 */
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"


/* Element kinds of the KV cache (kvrelay/attention/kv_format.py's kernel_code). Each is read straight
 * from the blocks and widened to float in registers: no dequantized copy of the cache exists.
 *   bf16      the top half of a float: shifted into place
 *   fp16      converted by the CPU (F16C's vcvtph2ps) where it has it, else by moving its bits
 *             into a float's and multiplying by 2^(127 - 15), which also gives subnormals exactly
 *   fp8 e5m2  the top byte of an fp16: shifted, then as fp16
 *   fp8 e4m3  its bits placed in an fp16 (exponent bias 15 instead of 7): the fp16 is the value
 *             times 2^-8 (subnormals included), so KV_UNIT folds 2^8 into the scales.
 * fp8's inf/NaN encodings are never written (kv_format saturates). */
enum { KV_F32 = 0, KV_BF16 = 1, KV_F16 = 2, KV_E4M3 = 3, KV_E5M2 = 4 };

typedef uint32_t vu __attribute__((vector_size(4 * VLEN)));
typedef uint16_t vh __attribute__((vector_size(2 * VLEN)));  /* VLEN fp16 bit patterns */
typedef uint16_t vu16_unaligned __attribute__((vector_size(2 * VLEN), aligned(1), may_alias));
typedef uint8_t vu8_unaligned __attribute__((vector_size(VLEN), aligned(1), may_alias));

static inline int64_t kv_elem_bytes(int kind) { return kind == KV_F32 ? 4 : kind <= KV_F16 ? 2 : 1; }
/* What a widened element must be multiplied by to be the stored value (folded into the scales). */
static inline float kv_unit(int kind) { return kind == KV_E4M3 ? 256.0f : 1.0f; }

#if defined(__F16C__) && VLEN == 16
#include <immintrin.h>
static inline vf halves_to_float(vh h) { return (vf)_mm512_cvtph_ps((__m256i)h); }
#elif defined(__F16C__) && VLEN == 8
#include <immintrin.h>
static inline vf halves_to_float(vh h) { return (vf)_mm256_cvtph_ps((__m128i)h); }
#else
static inline vf halves_to_float(vh h) {
    const vu w = __builtin_convertvector(h, vu);
    return (vf)(((w & 0x8000u) << 16) | ((w & 0x7fffu) << 13)) * 0x1p112f;
}
#endif

/* VLEN elements at p (element kind `kind`) as floats, in units of kv_unit(kind). */
static inline vf load_kv(int kind, const char *p) {
    if (kind == KV_F32) return load((const float *)p);
    if (kind == KV_BF16) return (vf)(__builtin_convertvector(*(const vu16_unaligned *)p, vu) << 16);
    if (kind == KV_F16) return halves_to_float(*(const vu16_unaligned *)p);
    const vh b = __builtin_convertvector(*(const vu8_unaligned *)p, vh);
    if (kind == KV_E5M2) return halves_to_float(b << 8);
    return halves_to_float(((b & 0x7f) << 7) | ((b & 0x80) << 8));
}

/* Element i of p as a float (the scalar twin of load_kv, same units). */
static inline float load_kv1(int kind, const char *p, int64_t i) {
    uint32_t bits;
    float f;
    switch (kind) {
        case KV_F32: return ((const float *)p)[i];
        case KV_BF16: bits = (uint32_t)((const uint16_t *)p)[i] << 16; memcpy(&f, &bits, 4); return f;
        case KV_F16: bits = ((const uint16_t *)p)[i]; break;
        case KV_E5M2: bits = (uint32_t)((const uint8_t *)p)[i] << 8; break;
        default: bits = ((const uint8_t *)p)[i]; bits = ((bits & 0x7fu) << 7) | ((bits & 0x80u) << 8); break;
    }
    bits = ((bits & 0x8000u) << 16) | ((bits & 0x7fffu) << 13);  /* an fp16's bits as a float's */
    memcpy(&f, &bits, 4);
    return f * 0x1p112f;
}

/* Asks for `bytes` bytes at p (a cache line at a time) ahead of their use. The kernel reads the
 * next block's rows this way as it reads the same rows of this one: the requests keep pace with
 * the reads, so memory stays busy while the block is computed. Asking for a whole block at once
 * at its start queued more requests than the core has room for, and the computation waited on
 * them: time = memory + compute, against the larger of the two once spread out. */
static inline void prefetch_bytes(const char *p, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + line);  /* 64 B: a cache line */
}

/* The query heads of one KV head (its GQA group) go through a block together, at most GROUP_PASS
 * of them per pass: each K and V row is loaded and widened once per pass, for all of them, and the
 * pass's accumulators stay in registers (4 rows x 4 heads of K products; V's below). A group larger
 * than GROUP_PASS reads the block once per pass of GROUP_PASS heads. score_rows and weighted_rows
 * are always inlined: left to itself the compiler called a copy with only some of the constants,
 * its accumulators in memory (slower than before for float32). */
#define GROUP_PASS 4
/* Vectors the V accumulators of a pass may take: the rest hold a V row's vector and the weights. */
#define V_ACC_REGS (VREGS - 4)

/* scores[g * stride + i] = q_g . k_i for the GB (<= GROUP_PASS) query heads of qs ([GB, VLEN C])
 * and `rows` rows of `k` ([rows, VLEN C] of element kind `kind`). Rows go 4 at a time, each row's
 * vectors loaded once and multiplied into GB accumulators; the horizontal sums of VLEN rows are
 * done together (halve4, join_quarters), VLEN - 1 halvings per head instead of VLEN hsums. The last
 * group of VLEN rows may run past `rows`: those rows repeat row rows - 1 (never a read outside the
 * block) and their scores are never read. `stride` is a multiple of VLEN. */
static inline __attribute__((always_inline)) void score_rows(
    int kind, int64_t C, int64_t GB, const float *qs, const char *k, int64_t rows, float *scores,
    int64_t stride, const char *ahead) {
    const int64_t row_bytes = VLEN * C * kv_elem_bytes(kind), vec_bytes = VLEN * kv_elem_bytes(kind);
    for (int64_t i0 = 0; i0 < rows; i0 += VLEN) {
        vf quarters[GROUP_PASS][VLEN / 4];  /* [head, 4 rows]: row partials from halve4 */
#pragma GCC unroll 4
        for (int64_t t = 0; t < VLEN / 4; t++) {
            const int64_t i = i0 + 4 * t;
            if (i >= rows) {
                for (int64_t g = 0; g < GB; g++) quarters[g][t] = (vf){0};
                continue;
            }
            prefetch_bytes(ahead + row_bytes * i, 4 * row_bytes);
            const char *row[4];
            for (int64_t r = 0; r < 4; r++) row[r] = k + row_bytes * (i + r < rows ? i + r : rows - 1);
            vf acc[4][GROUP_PASS];  /* [row, head] */
            for (int64_t r = 0; r < 4; r++)
                for (int64_t g = 0; g < GB; g++) acc[r][g] = (vf){0};
            for (int64_t c = 0; c < C; c++) {
                vf qc[GROUP_PASS];  /* vector c of each head's q, for the 4 rows */
                for (int64_t g = 0; g < GB; g++) qc[g] = load(qs + VLEN * (g * C + c));
                for (int64_t r = 0; r < 4; r++) {
                    const vf x = load_kv(kind, row[r] + vec_bytes * c);
                    for (int64_t g = 0; g < GB; g++) acc[r][g] += qc[g] * x;
                }
            }
            for (int64_t g = 0; g < GB; g++)
                quarters[g][t] = halve4(acc[0][g], acc[1][g], acc[2][g], acc[3][g]);
        }
        for (int64_t g = 0; g < GB; g++) store(scores + g * stride + i0, join_quarters(quarters[g]));
    }
}

/* Vectors of a V row per pass of weighted_rows: the largest divisor of C whose GB x chunk
 * accumulators fit in V_ACC_REGS (a constant where C and GB are). */
static inline int64_t v_chunk(int64_t C, int64_t GB) {
    for (int64_t chunk = V_ACC_REGS / GB < C ? V_ACC_REGS / GB : C; chunk > 1; chunk--)
        if (C % chunk == 0) return chunk;
    return 1;
}

/* acc_g = acc_g * rescale[g] + sum_i p[g * stride + i] v_i for the GB (<= GROUP_PASS) heads of acc
 * ([GB, VLEN C]) over `rows` rows of `v` ([rows, VLEN C] of element kind `kind`). The rows are read
 * in column chunks whose accumulators fit in registers, each vector of a row loaded once. */
static inline __attribute__((always_inline)) void weighted_rows(
    int kind, int64_t C, int64_t GB, float *acc, const float *rescale, const float *p, int64_t stride,
    const char *v, int64_t rows, const char *ahead) {
    const int64_t row_bytes = VLEN * C * kv_elem_bytes(kind), vec_bytes = VLEN * kv_elem_bytes(kind);
    const int64_t chunk = v_chunk(C, GB);
    for (int64_t c0 = 0; c0 < C; c0 += chunk) {
        vf a[GROUP_PASS][V_ACC_REGS];  /* [head, vector of the chunk] */
        for (int64_t g = 0; g < GB; g++)
            for (int64_t c = 0; c < chunk; c++) a[g][c] = load(acc + VLEN * (g * C + c0 + c)) * rescale[g];
        const char *row = v + vec_bytes * c0;
        for (int64_t i = 0; i < rows; i++, row += row_bytes) {
            if (c0 == 0) prefetch_bytes(ahead + row_bytes * i, row_bytes);
            for (int64_t c = 0; c < chunk; c++) {
                const vf x = load_kv(kind, row + vec_bytes * c);
                for (int64_t g = 0; g < GB; g++) a[g][c] += p[g * stride + i] * x;
            }
        }
        for (int64_t g = 0; g < GB; g++)
            for (int64_t c = 0; c < chunk; c++) store(acc + VLEN * (g * C + c0 + c), a[g][c]);
    }
}

/* Row i of `kv` ([rows, D] of element kind `kind`) as D floats in `row`: vectors, then one element
 * at a time for the last D % VLEN. */
static inline void widen_row(int kind, const char *kv, int64_t D, float *row) {
    int64_t d = 0;
    for (; d + VLEN <= D; d += VLEN) store(row + d, load_kv(kind, kv + d * kv_elem_bytes(kind)));
    for (; d < D; d++) row[d] = load_kv1(kind, kv, d);
}

/* score_rows and weighted_rows for any D (the route for D not a multiple of VLEN) and any number
 * of heads G: each row widened once into `row` ([D] scratch), then plain loops over it. */
static void score_rows_any(int kind, int64_t D, int64_t G, const float *qs, const char *k, int64_t rows,
                           float *scores, int64_t stride, float *row, const char *ahead) {
    for (int64_t i = 0; i < rows; i++) {
        prefetch_bytes(ahead + i * D * kv_elem_bytes(kind), D * kv_elem_bytes(kind));
        widen_row(kind, k + i * D * kv_elem_bytes(kind), D, row);
        for (int64_t g = 0; g < G; g++) {
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t d = 0; d < D; d++) sum += qs[g * D + d] * row[d];
            scores[g * stride + i] = sum;
        }
    }
}

static void weighted_rows_any(int kind, int64_t D, int64_t G, float *acc, const float *rescale,
                              const float *p, int64_t stride, const char *v, int64_t rows, float *row,
                              const char *ahead) {
    for (int64_t j = 0; j < G * D; j++) acc[j] *= rescale[j / D];
    for (int64_t i = 0; i < rows; i++) {
        prefetch_bytes(ahead + i * D * kv_elem_bytes(kind), D * kv_elem_bytes(kind));
        widen_row(kind, v + i * D * kv_elem_bytes(kind), D, row);
        for (int64_t g = 0; g < G; g++) {
            const float w = p[g * stride + i];
#pragma omp simd
            for (int64_t d = 0; d < D; d++) acc[g * D + d] += w * row[d];
        }
    }
}

/* The group's query heads [0, G) in passes of at most GROUP_PASS, each pass with its head count a
 * constant (a switch the branch predictor learns: every block takes the same cases). */
#define BY_PASS(CALL)                                              \
    for (int64_t g0 = 0; g0 < G; g0 += GROUP_PASS)                 \
        switch (G - g0 < GROUP_PASS ? G - g0 : GROUP_PASS) {       \
            case 1: CALL(1); break;                                \
            case 2: CALL(2); break;                                \
            case 3: CALL(3); break;                                \
            default: CALL(4); break;                               \
        }

static inline void score_group(int kind, int64_t C, int64_t D, int64_t G, const float *qs, const char *k,
                               int64_t rows, float *scores, int64_t stride, float *row, const char *ahead) {
    if (!C) {
        score_rows_any(kind, D, G, qs, k, rows, scores, stride, row, ahead);
        return;
    }
#define SCORE(GB) score_rows(kind, C, GB, qs + g0 * D, k, rows, scores + g0 * stride, stride, ahead)
    BY_PASS(SCORE)
#undef SCORE
}

static inline void weigh_group(int kind, int64_t C, int64_t D, int64_t G, float *acc, const float *rescale,
                               const float *p, int64_t stride, const char *v, int64_t rows, float *row,
                               const char *ahead) {
    if (!C) {
        weighted_rows_any(kind, D, G, acc, rescale, p, stride, v, rows, row, ahead);
        return;
    }
#define WEIGH(GB) \
    weighted_rows(kind, C, GB, acc + g0 * D, rescale + g0, p + g0 * stride, stride, v, rows, ahead)
    BY_PASS(WEIGH)
#undef WEIGH
}
#undef BY_PASS

/* Turns a block's scores into softmax numerators against the running maximum `*top`, updating
 * it and the running sum `*total`; returns the factor that rescales what was accumulated before.
 * Whole vectors throughout: `scores` is padded to a multiple of VLEN floats, the lanes past `rows`
 * masked out (their numerators are 0). */
static inline float online_softmax(float *scores, int64_t rows, float *top, float *total) {
    vi lane;
    for (int i = 0; i < VLEN; i++) lane[i] = i;
    vf block_top = splat(-FLT_MAX);
    for (int64_t i = 0; i < rows; i += VLEN) {
        const vi live = lane + (int32_t)i < (int32_t)rows;
        block_top = vmax(block_top, vselect(live, load(scores + i), splat(-FLT_MAX)));
    }
    const float tile_top = hmax(block_top), new_top = tile_top > *top ? tile_top : *top;
    const float rescale = *top == -FLT_MAX ? 0.0f : exp1(*top - new_top);
    vf sum = {0};
    for (int64_t i = 0; i < rows; i += VLEN) {
        const vi live = lane + (int32_t)i < (int32_t)rows;
        const vf e = vselect(live, exp_nonpositive(load(scores + i) - new_top), splat(0.0f));
        store(scores + i, e);
        sum += e;
    }
    *total = *total * rescale + hsum(sum);
    *top = new_top;
    return rescale;
}

/* Floats between two heads' scores in the scratch: block_size rounded up to whole vectors, as
 * score_rows stores a vector of VLEN rows' scores at a time. */
static inline int64_t scores_stride(int64_t block_size) { return (block_size + VLEN - 1) / VLEN * VLEN; }

/* KV heads [h0, h1) of sequence s. `work` is this thread's scratch: see paged_decode. */
static inline void attend(
    int kind, int64_t C, const float *q, int64_t q_row_stride, const char *kv, const float *kv_scales,
    const int64_t *block_tables, const int64_t *seq_lens, float *out, float *work, int64_t s, int64_t h0,
    int64_t h1, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
    int64_t max_blocks, float scale)
{
    const int64_t D = C ? VLEN * C : head_dim, group = num_heads / num_kv_heads;
    const int64_t heads = (h1 - h0) * group, first = h0 * group;  /* this item's query heads */
    const int64_t slice = block_size * D * kv_elem_bytes(kind);   /* bytes of one head's K (or V) */
    const int64_t block_stride = 2 * num_kv_heads * slice;
    const int64_t stride = scores_stride(block_size);
    const int64_t len = seq_lens[s];
    const int64_t *table = block_tables + s * max_blocks;
    float *qs = work;                            /* [heads, D] scaled queries */
    float *acc = qs + heads * D;                 /* [heads, D] running weighted sums of V */
    float *top = acc + heads * D;                /* [heads] running maxima */
    float *total = top + heads;                  /* [heads] running sums */
    float *scores = total + heads;               /* [heads, stride] this block's scores */
    float *row = scores + heads * stride;        /* [D] one widened row (score_rows_any) */
    const float *qrow = q + s * q_row_stride + first * D;
    for (int64_t j = 0; j < heads; j++) {
        /* fp8 K holds k / k_scale: q . k = (q * k_scale) . stored */
        const float qscale = scale * kv_unit(kind) * (kv_scales ? kv_scales[h0 + j / group] : 1.0f);
        for (int64_t d = 0; d < D; d++) { qs[j * D + d] = qrow[j * D + d] * qscale; acc[j * D + d] = 0.0f; }
        top[j] = -FLT_MAX; total[j] = 0.0f;
    }

    for (int64_t b = 0, t = 0; t < len; b++, t += block_size) {
        const int64_t rows = len - t < block_size ? len - t : block_size;
        const char *k = kv + table[b] * block_stride, *v = k + num_kv_heads * slice;
        /* The next block lies anywhere in the cache: its rows are asked for as this block's are
         * read (prefetch_bytes), the same rows of the same slices. */
        const char *next_k = kv + table[b + 1 < max_blocks ? b + 1 : b] * block_stride;
        const char *next_v = next_k + num_kv_heads * slice;
        for (int64_t h = h0; h < h1; h++) {
            const int64_t j = (h - h0) * group;  /* the group's first query head in this item */
            score_group(kind, C, D, group, qs + j * D, k + h * slice, rows, scores + j * stride, stride, row,
                        next_k + h * slice);
        }
        float rescale[heads];
        for (int64_t j = 0; j < heads; j++)
            rescale[j] = online_softmax(scores + j * stride, rows, top + j, total + j);
        for (int64_t h = h0; h < h1; h++) {
            const int64_t j = (h - h0) * group;
            weigh_group(kind, C, D, group, acc + j * D, rescale + j, scores + j * stride, stride,
                        v + h * slice, rows, row, next_v + h * slice);
        }
    }
    float *o = out + (s * num_heads + first) * D;
    for (int64_t j = 0; j < heads; j++) {
        /* fp8 V holds v / v_scale: the weighted sum scales back once, at the end */
        const float vscale = kv_unit(kind) * (kv_scales ? kv_scales[num_kv_heads + h0 + j / group] : 1.0f);
        /* (acc * vscale) / total: bit for bit acc / total when vscale is 1 (every format but fp8) */
        for (int64_t d = 0; d < D; d++) o[j * D + d] = acc[j * D + d] * vscale / total[j];
    }
}

/* Floats of scratch each thread needs (the caller allocates num_threads times this). */
int64_t paged_decode_scratch_floats(int64_t num_heads, int64_t head_dim, int64_t block_size) {
    return num_heads * (2 * head_dim + 2 + scores_stride(block_size)) + head_dim;
}

/* One work item, with the element kind and C constants so that each pair is its own unrolled copy. */
static void attend_item(int kind, const float *q, int64_t q_row_stride, const char *kv,
                        const float *kv_scales, const int64_t *block_tables, const int64_t *seq_lens,
                        float *out, float *work, int64_t s, int64_t h0, int64_t h1, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t max_blocks,
                        float scale)
{
#define ATTEND(K, C) attend(K, C, q, q_row_stride, kv, kv_scales, block_tables, seq_lens, out, work, s, h0, \
                            h1, num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale)
#define BY_HEAD_DIM(K)                                                   \
    switch (head_dim) { /* a constant C unrolls the vector loops */      \
        case 64: ATTEND(K, 64 / VLEN); break;                            \
        case 128: ATTEND(K, 128 / VLEN); break;                          \
        default: ATTEND(K, head_dim % VLEN ? 0 : head_dim / VLEN);       \
    }
    switch (kind) {
        case KV_F32: BY_HEAD_DIM(KV_F32); break;
        case KV_BF16: BY_HEAD_DIM(KV_BF16); break;
        case KV_F16: BY_HEAD_DIM(KV_F16); break;
        case KV_E4M3: BY_HEAD_DIM(KV_E4M3); break;
        default: BY_HEAD_DIM(KV_E5M2); break;
    }
#undef BY_HEAD_DIM
#undef ATTEND
}

void paged_decode(
    const float *q,               /* [num_seqs, num_heads, head_dim], rows q_row_stride apart */
    int64_t q_row_stride,         /* floats between two sequences' queries */
    const void *kv,               /* [num_blocks, 2, num_kv_heads, block_size, head_dim], kind `kind` */
    int kind,                     /* KV_F32 .. KV_E5M2 */
    const float *kv_scales,       /* [2, num_kv_heads]: K then V scales (fp8), or NULL */
    const int64_t *block_tables,  /* [num_seqs, max_blocks], row-major */
    const int64_t *seq_lens,      /* [num_seqs], tokens of context, >= 1 */
    float *out,                   /* [num_seqs, num_heads, head_dim], contiguous */
    float *scratch,               /* [num_threads, paged_decode_scratch_floats(...)] */
    int64_t num_seqs, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
    int64_t block_size, int64_t max_blocks, float scale, int num_threads)
{
    /* Whole sequences read each block front to back; with fewer than 4 per thread, split them by
     * KV head so that every thread has work. */
    const int64_t parts = num_seqs >= 4 * num_threads ? 1 : num_kv_heads;
    const int64_t per_thread = paged_decode_scratch_floats(num_heads, head_dim, block_size);
#pragma omp parallel num_threads(num_threads)
    {
        float *work = scratch + omp_get_thread_num() * per_thread;
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_seqs * parts; item++) {
            const int64_t s = item / parts;
            const int64_t h0 = parts == 1 ? 0 : item % parts, h1 = parts == 1 ? num_kv_heads : h0 + 1;
            attend_item(kind, q, q_row_stride, (const char *)kv, kv_scales, block_tables, seq_lens, out,
                        work, s, h0, h1, num_heads, num_kv_heads, head_dim, block_size, max_blocks, scale);
        }
    }
}
