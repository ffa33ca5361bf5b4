/* y = x . W^T (+ bias) for the CPU, float32, for the few-row products of decode steps.
 *
 * Compiled on first use by kvrelay/model/native.py (cc -O3 -march=native -fopenmp) and called
 * through ctypes; kvrelay/model/layers.py uses it for 3..512 rows and MKL (through torch) for the
 * rest, or everywhere when it is unavailable.
 *
 * Why: MKL multiplies a 576 x 3072 weight by 8-48 rows at 50-100 GFLOP/s on this project's 2-core
 * machine, far under both of its limits (reading the weight once, and ~200 GFLOP/s of FMAs). Here
 * each thread owns a contiguous range of the weight's rows and walks it in blocks that stay in its
 * L2 cache, reading each block from memory once; all the x rows pass over a block, 6 at a time, in
 * tiles of 4 weight rows x 6 x rows: 24 running dot products in registers, 10 loads per 24 FMAs.
 *
 * Layout: x [M, K] (row stride ldx), W [N, K] row-major (as torch stores a Linear's weight),
 * bias [N] or NULL, y [M, N] contiguous. Needs K % 16 == 0 and N % 4 == 0 (the caller checks).
 */
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

/* The lane sums of a, b, c and d, as one 4-vector: halves of pairs of vectors are added together,
 * so 4 vectors take 5 rounds of shuffles and adds, not 4 separate 15-add reductions. */
static inline vf4 sums4(vf a, vf b, vf c, vf d) {
    vf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
          + __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    vf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23)
          + __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
    /* ab: 8 partial sums of a, then 8 of b; cd likewise. Now 4 of each of a, b, c, d: */
    vf q = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27)
         + __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    vf8 h = __builtin_shufflevector(q, q, 0, 1, 4, 5, 8, 9, 12, 13)
          + __builtin_shufflevector(q, q, 2, 3, 6, 7, 10, 11, 14, 15);
    return __builtin_shufflevector(h, h, 0, 2, 4, 6) + __builtin_shufflevector(h, h, 1, 3, 5, 7);
}

#define NR 4           /* weight rows per tile */
#define MR 6           /* x rows per tile */
#define BLOCK (1 << 16) /* floats of weight per cache block: 256 KB, a quarter of a 1 MB L2 */

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
        for (int64_t k = 0; k < K; k += 16) {                                                       \
            if (PF)                                                                                 \
                for (int i = 0; i < NR; i++) __builtin_prefetch(w + (NR + i) * K + k, 0, 3);        \
            vf w0 = load(w + k), w1 = load(w + K + k), w2 = load(w + 2 * K + k),                    \
               w3 = load(w + 3 * K + k);                                                            \
            for (int j = 0; j < R; j++) {                                                           \
                vf xv = load(x + j * ldx + k);                                                      \
                /* keep xv in a register: else the compiler folds a load into each of the 4 FMAs,   \
                 * 28 loads per 24 FMAs instead of 10, and the loads become the bottleneck */       \
                __asm__("" : "+v"(xv));                                                             \
                acc[j][0] += xv * w0;                                                               \
                acc[j][1] += xv * w1;                                                               \
                acc[j][2] += xv * w2;                                                               \
                acc[j][3] += xv * w3;                                                               \
            }                                                                                       \
        }                                                                                           \
        const vf4 b = bias ? load4(bias) : (vf4){0};                                                \
        for (int j = 0; j < R; j++)                                                                 \
            store4(y + j * ldy, sums4(acc[j][0], acc[j][1], acc[j][2], acc[j][3]) + b);             \
    }

DEFINE_TILE(1, 0) DEFINE_TILE(2, 0) DEFINE_TILE(3, 0) DEFINE_TILE(4, 0) DEFINE_TILE(5, 0) DEFINE_TILE(6, 0)
DEFINE_TILE(1, 1) DEFINE_TILE(2, 1) DEFINE_TILE(3, 1) DEFINE_TILE(4, 1) DEFINE_TILE(5, 1) DEFINE_TILE(6, 1)

typedef void (*tile_fn)(int64_t, const float *, int64_t, const float *, float *, int64_t, const float *);
static const tile_fn TILES[2][MR + 1] = {
    {0, tile_1_0, tile_2_0, tile_3_0, tile_4_0, tile_5_0, tile_6_0},
    {0, tile_1_1, tile_2_1, tile_3_1, tile_4_1, tile_5_1, tile_6_1},
};

void linear_f32(const float *x, int64_t ldx, const float *w, const float *bias, float *y, int64_t M,
                int64_t N, int64_t K, int num_threads) {
    int64_t rows_per_block = BLOCK / K / NR * NR;
    if (rows_per_block < NR) rows_per_block = NR;
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t t = omp_get_thread_num(), T = omp_get_num_threads(), tiles = N / NR;
        const int64_t lo = tiles * t / T * NR, hi = tiles * (t + 1) / T * NR;  /* this thread's rows */
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
