/* Batch-invariant linear layers: out[M, N] = x[M, K] . W[N, K]^T (+ bias) where every output
 * element is one fp32 accumulation over k = 0, 1, ..., K-1 in that order, whatever M is, wherever
 * the row sits in the batch and however the work is split over threads. oneDNN and MKL pick their
 * blocking (and, at few rows, a K split across threads) from the shape, so a row's sums there
 * depend on how many rows share the call; in bf16 that difference flips greedy tokens.
 *
 * The weight is packed once (kernels/invariant_linear.py) into panels of 32 output columns:
 *   bf16: uint32 [N/32][K/2][32], word = W[n][2p] | W[n][2p+1] << 16 (a pair of k per word)
 *   fp32: float  [N/32][K][32]
 * (N padded to 32, and for bf16 K to 2, with zeros). Vectors run across output columns, so no sum is ever
 * split across lanes or reduced horizontally; a micro-tile of MR rows shares each weight load.
 *
 * bf16 with AVX512_BF16: vdpbf16ps adds each k pair's two products to the fp32 sum (the same
 * instruction on every row). bf16 elsewhere and fp32: one FMA per k (bf16 products are exact in
 * fp32, so for bf16 the two paths differ only in how the pair's sum rounds). bf16 outputs are
 * rounded once, after the bias. MR = 12 on AVX-512 (24 accumulators of 32 registers); 4 on AVX2,
 * where 6 measured slower in fp32.
 *
 * Built without -fassociative-math (the pragma below): that flag lets the compiler re-associate
 * the k loop differently in each unrolled variant, which is the very thing this file rules out.
 */
#if defined(__clang__)
#pragma clang fp reassociate(off)
#else
#pragma GCC optimize("no-associative-math")
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#include "bf16.h"

#pragma GCC diagnostic ignored "-Wpsabi" /* wide vectors without AVX: internal functions only */

#define PW 32  /* output columns per panel */
#define MB 64  /* rows per task: its x rows and its panel stay in L2 */

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#define NV 2            /* vectors per column group */
#define CG (NV * VW)    /* columns per group: 32, 16 or 8 (divides PW) */
#if VW == 16
#define MR 12           /* rows per micro-tile: MR x NV accumulators */
#else
#define MR 4
#endif

typedef float vf __attribute__((vector_size(4 * VW)));
typedef uint32_t vu __attribute__((vector_size(4 * VW)));

INLINE vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE vu uload(const uint32_t *p) {
    vu v;
    memcpy(&v, p, sizeof v);
    return v;
}

INLINE float x_at(const void *x, size_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)x)[i]) : ((const float *)x)[i];
}

/* acc + bias rounded into out row (bf16 or fp32), columns [c0, c0 + n). */
INLINE void store_row(const float *acc, const float *bias, void *out, size_t off, int c0, int n, int bf16) {
    for (int j = 0; j < n; j++) {
        const float v = bias ? acc[j] + bias[c0 + j] : acc[j];
        if (bf16)
            ((uint16_t *)out)[off + (size_t)c0 + j] = to_bf16_bits(v);
        else
            ((float *)out)[off + (size_t)c0 + j] = v;
    }
}

/* Rows [r0, r0 + nr) x columns [col, col + CG) of panel `panel` (first column n0), by FMAs.
 * wbf16: the panel holds bf16 pairs; else fp32. xbf16: x is bf16; else fp32. */
INLINE void tile_fma(const void *x, size_t xs, int r0, int nr, const void *panel, int K, int col, int n0,
                     int N, const float *bias, void *out, int wbf16, int xbf16) {
    vf acc[MR][NV];
    for (int r = 0; r < MR; r++)
        for (int v = 0; v < NV; v++)
            acc[r][v] = (vf){0};
    if (wbf16) {
        const int KP = (K + 1) / 2;
        for (int kp = 0; kp < KP; kp++) {
            const uint32_t *w = (const uint32_t *)panel + (size_t)kp * PW + col;
            vf we[NV], wo[NV];
            for (int v = 0; v < NV; v++) {
                const vu u = uload(w + v * VW);
                we[v] = (vf)(u << 16);
                wo[v] = (vf)(u & 0xFFFF0000u);
            }
            for (int r = 0; r < MR; r++) {
                if (r < nr) {
                    const size_t row = (size_t)(r0 + r) * xs;
                    const float xe = x_at(x, row + 2 * (size_t)kp, xbf16);
                    const float xo = 2 * kp + 1 < K ? x_at(x, row + 2 * (size_t)kp + 1, xbf16) : 0.f;
                    for (int v = 0; v < NV; v++) {
                        acc[r][v] = acc[r][v] + xe * we[v];
                        acc[r][v] = acc[r][v] + xo * wo[v];
                    }
                }
            }
        }
    } else {
        for (int k = 0; k < K; k++) {
            const float *w = (const float *)panel + (size_t)k * PW + col;
            vf wv[NV];
            for (int v = 0; v < NV; v++)
                wv[v] = vload(w + v * VW);
            for (int r = 0; r < MR; r++) {
                if (r < nr) {
                    const float xv = x_at(x, (size_t)(r0 + r) * xs + k, xbf16);
                    for (int v = 0; v < NV; v++)
                        acc[r][v] = acc[r][v] + xv * wv[v];
                }
            }
        }
    }
    const int c0 = n0 + col, n = N - c0 < CG ? N - c0 : CG;
    for (int r = 0; r < nr; r++) {
        float a[CG];
        memcpy(a, acc[r], sizeof a);
        store_row(a, bias, out, (size_t)(r0 + r) * N, c0, n, xbf16);
    }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define DP_MR 12

/* bf16 rows [r0, r0 + nr) x the panel's 32 columns by vdpbf16ps; K even (the caller pads). */
INLINE void tile_dp(const uint16_t *x, size_t xs, int r0, int nr, const uint32_t *panel, int K, int n0, int N,
                    const float *bias, uint16_t *out) {
    __m512 acc[DP_MR][2];
    for (int r = 0; r < DP_MR; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int KP = K / 2;
    for (int kp = 0; kp < KP; kp++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + (size_t)kp * PW);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + (size_t)kp * PW + 16);
        for (int r = 0; r < DP_MR; r++) {
            if (r < nr) {
                uint32_t pair;
                memcpy(&pair, x + (size_t)(r0 + r) * xs + 2 * (size_t)kp, sizeof pair);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
            }
        }
    }
    const int n = N - n0 < PW ? N - n0 : PW;
    for (int r = 0; r < nr; r++) {
        float a[PW];
        _mm512_storeu_ps(a, acc[r][0]);
        _mm512_storeu_ps(a + 16, acc[r][1]);
        store_row(a, bias, out, (size_t)(r0 + r) * N, n0, n, 1);
    }
}
#endif

/* One task: rows [m0, m0 + MB) of x against panel p. */
INLINE void run_task(const void *x, size_t xs, int M, const void *panels, int N, int K, const float *bias,
                     void *out, int p, int m0, int wbf16, int xbf16) {
    const int m1 = m0 + MB < M ? m0 + MB : M;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (wbf16 && xbf16 && K % 2 == 0) {
        const uint32_t *panel = (const uint32_t *)panels + (size_t)p * (K / 2) * PW;
        for (int r = m0; r < m1; r += DP_MR)
            tile_dp(x, xs, r, m1 - r < DP_MR ? m1 - r : DP_MR, panel, K, p * PW, N, bias, out);
        return;
    }
#endif
    const size_t panel_elems = (size_t)(wbf16 ? (K + 1) / 2 : K) * PW;
    const void *panel = wbf16 ? (const void *)((const uint32_t *)panels + (size_t)p * panel_elems)
                              : (const void *)((const float *)panels + (size_t)p * panel_elems);
    for (int col = 0; col < PW && p * PW + col < N; col += CG)
        for (int r = m0; r < m1; r += MR)
            tile_fma(x, xs, r, m1 - r < MR ? m1 - r : MR, panel, K, col, p * PW, N, bias, out, wbf16, xbf16);
}

/* x [M, K] with row stride xs elements (bf16 when xbf16, else fp32), packed panels (bf16 pairs
 * when wbf16, else fp32), bias fp32 [N] or NULL, out [M, N] contiguous in x's dtype.
 * Returns 0, or -1 for a shape this kernel does not take. */
int baton_linear_invariant(const void *x, const void *panels, const float *bias, void *out, int64_t M,
                           int64_t N, int64_t K, int64_t xs, int wbf16, int xbf16, int nthreads) {
    if (M < 0 || N <= 0 || K <= 0 || xs < K || M > (1LL << 30) || N > (1LL << 30) || K > (1LL << 30))
        return -1;
    if (M == 0)
        return 0;
    const int np = (int)((N + PW - 1) / PW), nm = (int)((M + MB - 1) / MB);
    const long tasks = (long)np * nm;
    /* a parallel region costs a few microseconds: small products stay on one thread */
    const int par = M * N * K >= (1LL << 17) && tasks > 1;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (par)
    for (long t = 0; t < tasks; t++)
        run_task(x, (size_t)xs, (int)M, panels, (int)N, (int)K, bias, out, (int)(t % np), (int)(t / np) * MB,
                 wbf16, xbf16);
    return 0;
}
