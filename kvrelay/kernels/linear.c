/* y = x . W^T (+ bias) for the CPU, float32, for the few-row products of decode steps.
 *
 * Compiled on first use by kvrelay/kernels/native.py (cc -O3 -march=<target> -fopenmp) and called
 * through ctypes; kvrelay/model/layers.py uses it for 1..512 rows and MKL (through torch) for the
 * rest, or everywhere when it is unavailable.
 *
 * Why: MKL multiplies a 576 x 3072 weight by 8-48 rows at 50-100 GFLOP/s on this project's 2-core
 * machine, far under both of its limits (reading the weight once, and ~200 GFLOP/s of FMAs). Here
 * each thread owns a contiguous range of the weight's rows and walks it in blocks that stay in its
 * L2 cache, reading each block from memory once; all the x rows pass over a block, a few at a time,
 * in tiles of 4 weight rows x MR x rows, the running dot products held in registers: with 32 vector
 * registers (AVX-512) 6 x rows, 24 sums, 10 loads per 24 FMAs; with 16 (AVX2) 3 x rows, 12 sums, 7
 * loads per 12 FMAs (3 x 4 measured at ~70% of this CPU's 256-bit FMA peak at 64 rows, as 6 x 4 is
 * of the 512-bit one; 2 x 4 and 4 x 4, which spills, were no faster).
 *
 * One or two rows (single-stream decode) read the weight once and do almost no arithmetic, so
 * only how the weight streams matters: there each thread walks its rows one after another, a
 * single sequential stream, which on an AMD EPYC read SmolLM2's weights at 29-31 GB/s against
 * 24-27 for the 4-row tiles' four interleaved streams (2026-12-03, both builds).
 *
 * Layout: x [M, K] (row stride ldx), W [N, K] row-major (as torch stores a Linear's weight),
 * bias [N] or NULL, y [M, N] contiguous. Needs K % 16 == 0 and N % 4 == 0 (the caller checks).
 */
#include <omp.h>
#include <stddef.h>
#include <stdint.h>

#include "simd.h"

#define NR 4            /* weight rows per tile */
#define BLOCK (1 << 16) /* floats of weight per cache block: 256 KB, a quarter of a 1 MB L2 */
#define KSTEP 16        /* floats of K per step: one cache line, 16 / VLEN vectors of each row */
#if VREGS >= 32
#define MR 6 /* x rows per tile: 24 accumulators + 4 weight vectors + 1 x vector = 29 registers */
#else
#define MR 3 /* 12 accumulators + 3 x vectors + 1 weight vector = 16 registers */
#endif

/* acc[j][i] += x_j . w_i over one vector of K (offset k), for j < R and i < NR, reading each
 * vector once. Two orders, by what fits in the registers beside the accumulators: the 4 weight
 * vectors held while each x vector passes (4 + 1 live, 10 loads per 24 FMAs at R = 6), or the R
 * x vectors held while each weight vector passes (R + 1 live, 7 loads per 12 FMAs at R = 3).
 * KEEP_IN_REGISTER stops the compiler from folding a held vector's load into each of its FMAs,
 * which made the loads the bottleneck. */
#if MR == 6
#define TILE_STEP(R)                                                                                \
    {                                                                                               \
        vf w0 = load(w + k), w1 = load(w + K + k), w2 = load(w + 2 * K + k), w3 = load(w + 3 * K + k); \
        for (int j = 0; j < R; j++) {                                                               \
            vf xv = load(x + j * ldx + k);                                                          \
            KEEP_IN_REGISTER(xv);                                                                   \
            acc[j][0] += xv * w0;                                                                   \
            acc[j][1] += xv * w1;                                                                   \
            acc[j][2] += xv * w2;                                                                   \
            acc[j][3] += xv * w3;                                                                   \
        }                                                                                           \
    }
#else
#define TILE_STEP(R)                                                                                \
    {                                                                                               \
        vf xv[R];                                                                                   \
        for (int j = 0; j < R; j++) { xv[j] = load(x + j * ldx + k); KEEP_IN_REGISTER(xv[j]); }     \
        for (int i = 0; i < NR; i++) {                                                              \
            vf wv = load(w + i * K + k);                                                            \
            KEEP_IN_REGISTER(wv);                                                                   \
            for (int j = 0; j < R; j++) acc[j][i] += xv[j] * wv;                                    \
        }                                                                                           \
    }
#endif

/* One tile: y[j, 0..3] = x[j] . w[0..3] (+ bias[0..3]) for j < R. With PF, it also prefetches the
 * next tile's weight rows, line by line as it reads its own: the first pass over a block reads it
 * from memory, and without this it ran 5-10% slower at 4-32 rows. (Past the end of the weight the
 * prefetch is harmless: a prefetch never faults.) */
#define DEFINE_TILE(R, PF)                                                                          \
    static void tile_##R##_##PF(int64_t K, const float *x, int64_t ldx, const float *w, float *y,   \
                                int64_t ldy, const float *bias) {                                   \
        vf acc[R][NR];                                                                              \
        for (int j = 0; j < R; j++)                                                                 \
            for (int i = 0; i < NR; i++) acc[j][i] = (vf){0};                                       \
        for (int64_t line = 0; line < K; line += KSTEP) {                                           \
            if (PF)                                                                                 \
                for (int i = 0; i < NR; i++) __builtin_prefetch(w + (NR + i) * K + line, 0, 3);     \
            for (int64_t k = line; k < line + KSTEP; k += VLEN) TILE_STEP(R)                        \
        }                                                                                           \
        const vf4 b = bias ? load4(bias) : (vf4){0};                                                \
        for (int j = 0; j < R; j++)                                                                 \
            store4(y + j * ldy, sums4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]) + b);             \
    }

#if MR == 6
DEFINE_TILE(1, 0) DEFINE_TILE(2, 0) DEFINE_TILE(3, 0) DEFINE_TILE(4, 0) DEFINE_TILE(5, 0) DEFINE_TILE(6, 0)
DEFINE_TILE(1, 1) DEFINE_TILE(2, 1) DEFINE_TILE(3, 1) DEFINE_TILE(4, 1) DEFINE_TILE(5, 1) DEFINE_TILE(6, 1)
#define TILE_TABLE(PF) {0, tile_1_##PF, tile_2_##PF, tile_3_##PF, tile_4_##PF, tile_5_##PF, tile_6_##PF}
#else
DEFINE_TILE(1, 0) DEFINE_TILE(2, 0) DEFINE_TILE(3, 0)
DEFINE_TILE(1, 1) DEFINE_TILE(2, 1) DEFINE_TILE(3, 1)
#define TILE_TABLE(PF) {0, tile_1_##PF, tile_2_##PF, tile_3_##PF}
#endif

/* y[j, 0..3] for j < R <= 2 and four weight rows, one weight row at a time: a single sequential
 * stream through the weight, which the hardware prefetchers follow best when reading the weight is
 * the whole cost. Each dot product is summed in the order of TILE_STEP and the tile's sums4, so a
 * row's result does not depend on how many rows share the call. */
static void rows4_few(int64_t R, int64_t K, const float *x, int64_t ldx, const float *w, float *y, int64_t ldy,
                      const float *bias) {
    vf acc[2][NR];
    for (int i = 0; i < NR; i++) {
        const float *wi = w + i * K;
        vf a0 = (vf){0}, a1 = (vf){0};
        if (R == 1)
            for (int64_t k = 0; k < K; k += VLEN) a0 += load(x + k) * load(wi + k);
        else
            for (int64_t k = 0; k < K; k += VLEN) {
                const vf wv = load(wi + k);
                a0 += load(x + k) * wv;
                a1 += load(x + ldx + k) * wv;
            }
        acc[0][i] = a0;
        acc[1][i] = a1;
    }
    const vf4 b = bias ? load4(bias) : (vf4){0};
    for (int j = 0; j < R; j++) store4(y + j * ldy, sums4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]) + b);
}

typedef void (*tile_fn)(int64_t, const float *, int64_t, const float *, float *, int64_t, const float *);
static const tile_fn TILES[2][MR + 1] = {TILE_TABLE(0), TILE_TABLE(1)};

void linear_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y, int64_t M,
                int64_t N, int64_t K, int num_threads) {
    int64_t rows_per_block = BLOCK / K / NR * NR;
    if (rows_per_block < NR) rows_per_block = NR;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads(), tiles = N / NR;
        const int64_t lo = tiles * t / T * NR, hi = tiles * (t + 1) / T * NR;  /* this thread's rows */
        if (M <= 2) {
            for (int64_t n = lo; n < hi; n += NR)
                rows4_few(M, K, x, ldx, w + n * K, y + n, N, bias ? bias + n : NULL);
        } else {
            for (int64_t block = lo; block < hi; block += rows_per_block) {
                const int64_t end = block + rows_per_block < hi ? block + rows_per_block : hi;
                for (int64_t m = 0; m < M; m += MR) {
                    const tile_fn tile = TILES[m == 0][M - m < MR ? M - m : MR];  /* first pass prefetches */
                    for (int64_t n = block; n < end; n += NR)
                        tile(K, x + m * ldx, ldx, w + n * K, y + m * N + n, N, bias ? bias + n : NULL);
                }
            }
        }
    }
}
