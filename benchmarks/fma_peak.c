/* This CPU's peak float32 FMA rate: twelve independent chains of vector FMAs per thread, held in
 * registers, nothing read from memory. benchmarks/floors.py compiles it (cc -O3 -march=native
 * -fopenmp) and divides a workload's FLOPs by it: no float32 implementation can beat that time. */
#include <omp.h>
#include <stdint.h>

#include "simd.h" /* kvrelay/kernels/simd.h: vf as wide as the target's registers, KEEP_IN_REGISTER */

#define STEP(a) a = a * m + c;

/* FLOP/s of `iters` rounds of 12 vector FMAs on each of `threads` threads. */
double fma_peak(int64_t iters, int threads) {
    const double start = omp_get_wtime();
    float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
        const vf m = (vf){0} + 0.999999f, c = (vf){0} + 1e-7f;
        vf a0 = m, a1 = m + 1, a2 = m + 2, a3 = m + 3, a4 = m + 4, a5 = m + 5;
        vf a6 = m + 6, a7 = m + 7, a8 = m + 8, a9 = m + 9, a10 = m + 10, a11 = m + 11;
        for (int64_t n = 0; n < iters; n++) {
            STEP(a0) STEP(a1) STEP(a2) STEP(a3) STEP(a4) STEP(a5)
            STEP(a6) STEP(a7) STEP(a8) STEP(a9) STEP(a10) STEP(a11)
            /* Keeps every chain in a register (an array of them lands on the stack). */
            KEEP_IN_REGISTER(a0); KEEP_IN_REGISTER(a1); KEEP_IN_REGISTER(a2); KEEP_IN_REGISTER(a3);
            KEEP_IN_REGISTER(a4); KEEP_IN_REGISTER(a5); KEEP_IN_REGISTER(a6); KEEP_IN_REGISTER(a7);
            KEEP_IN_REGISTER(a8); KEEP_IN_REGISTER(a9); KEEP_IN_REGISTER(a10); KEEP_IN_REGISTER(a11);
        }
        const vf s = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9 + a10 + a11;
        sink += s[0];
    }
    const double seconds = omp_get_wtime() - start;
    return (double)iters * 12 * 2 * VLEN * threads / seconds + (sink != sink);
}
