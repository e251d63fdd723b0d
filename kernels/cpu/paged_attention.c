/* Paged decode attention for CPUs: one query token per sequence, read straight from the block
 * table (no gather copy, no padding to the longest sequence), online softmax in fp32.
 * One task per (sequence, KV head); the G query heads sharing that KV head are done together so
 * each K/V row is read from memory once. Built by kernels/cpu_ops.py with -O3 -march=native
 * -fopenmp (never -ffast-math).
 *
 * Contract of paged_decode_{bf16,f32}: q is fp32 [S, Hq, D] already rounded to the cache dtype
 * and out fp32 [S, Hq, D], or both bf16 with io_bf16 = 1; caches [blocks, BS, Hkv, D]; tables
 * [S, MB] int32 (entries past a sequence are never read). Needs Hq % Hkv == 0, Hq / Hkv <= 16,
 * D <= 256, BS <= 128.
 * With AVX-512 (and D % 16 == 0; bf16 also D % 32 == 0 when AVX512_BF16 does the dots) the
 * AVX-512 kernel runs; otherwise, for D % 8 == 0, the vec8 kernel (8-lane generic vectors: AVX2,
 * SSE2 or NEON registers; about 2.5x the portable loop on AVX2); otherwise the portable loop.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "bf16.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define MAX_G 16
#define MAX_D 256
#define MAX_BS 128
#ifndef PF_BLOCKS
#define PF_BLOCKS 2 /* prefetch distance in blocks: 2 measures best, 3 within 5%, 1 too late */
#endif


#define DEFINE_DECODE(NAME, T, LOAD)                                                            \
static void NAME(const float *restrict q, const T *restrict kc, const T *restrict vc,           \
          const int32_t *restrict tables, const int32_t *restrict lens, float *restrict out,     \
          int S, int Hq, int Hkv, int D, int BS, int MB, float scale, int window, int nthreads) { \
    const int G = Hq / Hkv;                                                                      \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(nthreads)")           \
    for (int s = 0; s < S; s++) {                                                                \
        for (int h = 0; h < Hkv; h++) {                                                          \
            float acc[MAX_G][MAX_D];                                                             \
            float qf[MAX_G][MAX_D];                                                              \
            float m[MAX_G], l[MAX_G];                                                            \
            float sc[MAX_G][MAX_BS];                                                             \
            float row[MAX_D];                                                                    \
            const int L = lens[s];                                                               \
            const int start = (window > 0 && L > window) ? L - window : 0;                       \
            for (int g = 0; g < G; g++) {                                                        \
                const float *qp = q + ((size_t)s * Hq + (size_t)h * G + g) * D;                  \
                for (int d = 0; d < D; d++) { qf[g][d] = qp[d] * scale; acc[g][d] = 0.f; }       \
                m[g] = -1e30f; l[g] = 0.f; /* finite: exp(m - mx) must be 0, never NaN */        \
            }                                                                                    \
            for (int b0 = start - start % BS; b0 < L; b0 += BS) {                                \
                const int blk = tables[(size_t)s * MB + b0 / BS];                                \
                const int lo = b0 < start ? start - b0 : 0;                                      \
                const int hi = (L - b0) < BS ? (L - b0) : BS;                                    \
                for (int t = lo; t < hi; t++) {                                                  \
                    const T *kp = kc + (((size_t)blk * BS + t) * Hkv + h) * D;                   \
                    for (int d = 0; d < D; d++) row[d] = LOAD(kp[d]);                            \
                    for (int g = 0; g < G; g++) {                                                \
                        float dot = 0.f;                                                         \
                        for (int d = 0; d < D; d++) dot += qf[g][d] * row[d];                    \
                        sc[g][t] = dot;                                                          \
                    }                                                                            \
                }                                                                                \
                for (int g = 0; g < G; g++) {                                                    \
                    float mx = m[g];                                                             \
                    for (int t = lo; t < hi; t++) mx = sc[g][t] > mx ? sc[g][t] : mx;            \
                    const float corr = expf(m[g] - mx);                                          \
                    l[g] *= corr;                                                                \
                    for (int d = 0; d < D; d++) acc[g][d] *= corr;                               \
                    for (int t = lo; t < hi; t++) { sc[g][t] = expf(sc[g][t] - mx); l[g] += sc[g][t]; } \
                    m[g] = mx;                                                                   \
                }                                                                                \
                for (int t = lo; t < hi; t++) {                                                  \
                    const T *vp = vc + (((size_t)blk * BS + t) * Hkv + h) * D;                   \
                    for (int d = 0; d < D; d++) row[d] = LOAD(vp[d]);                            \
                    for (int g = 0; g < G; g++) {                                                \
                        const float p = sc[g][t];                                                \
                        for (int d = 0; d < D; d++) acc[g][d] += p * row[d];                     \
                    }                                                                            \
                }                                                                                \
            }                                                                                    \
            for (int g = 0; g < G; g++) {                                                        \
                float *op = out + ((size_t)s * Hq + (size_t)h * G + g) * D;                      \
                const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;                                 \
                for (int d = 0; d < D; d++) op[d] = acc[g][d] * inv;                             \
            }                                                                                    \
        }                                                                                        \
    }                                                                                            \
}

#define LOAD_BF16(x) bf16_to_f32(x)
#define LOAD_F32(x) (x)
DEFINE_DECODE(decode_portable_bf16, uint16_t, LOAD_BF16)
DEFINE_DECODE(decode_portable_f32, float, LOAD_F32)

#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#if defined(__AVX512BF16__)
#define BF16_DOT 1 /* q.k by vdpbf16ps on bf16 pairs: products are exact, sums fp32 */
#else
#define BF16_DOT 0
#endif

#include "vexp.h"

/* Lane j of the result is the sum of the 16 lanes of a[j]: a transpose-and-add tree, 45 ops for
 * 16 dot products instead of 16 serial horizontal reductions. */
INLINE __m512 hsum16x16(const __m512 a[16]) {
    __m512 b[8], c[4];
    for (int i = 0; i < 8; i++)  /* per 128-bit lane: [A0+A2, B0+B2, A1+A3, B1+B3] */
        b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) {  /* per 128-bit lane: the lane sums of a[4i..4i+3] */
        const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
        c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 e0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                    _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
    const __m512 e1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                                    _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(e0, e1, 0x88), _mm512_shuffle_f32x4(e0, e1, 0xDD));
}

/* 16 consecutive cache elements as fp32 (bf16 is the top half of an fp32: widen and shift). */
INLINE __m512 load16(const void *p, int bf16) {
    if (bf16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
    return _mm512_loadu_ps(p);
}

/* 16 partial sums of q . k for one K row; q is D/32 bf16-pair vectors or D/16 fp32 vectors. */
INLINE __m512 dot_partial(const __m512 *qv, const void *k, int D, int bf16) {
    __m512 acc = _mm512_setzero_ps();
#if BF16_DOT
    if (bf16) {
        for (int c = 0; c < D / 32; c++)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)qv[c],
                                   (__m512bh)_mm512_loadu_si512((const uint16_t *)k + 32 * c));
        return acc;
    }
#endif
    for (int c = 0; c < D / 16; c++)
        acc = _mm512_fmadd_ps(qv[c], load16((const char *)k + (size_t)c * 16 * (bf16 ? 2 : 4), bf16), acc);
    return acc;
}

/* For NG (1..4) heads and NC (1..4) 16-wide columns: acc[g] = acc[g] * corr[g] + sum_t p[g][t] v[t].
 * Tokens outermost, so each V row is loaded once and the NG * NC FMA chains overlap. */
INLINE void pv_tile(float *acc, const float *corr, const float *p, const char *v, size_t vstride,
                    int n, int NG, int NC, int bf16) {
    __m512 a[4][4];
    for (int g = 0; g < NG; g++)
        for (int j = 0; j < NC; j++)
            a[g][j] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * MAX_D + 16 * j), _mm512_set1_ps(corr[g]));
    for (int t = 0; t < n; t++) {
        __m512 vv[4];
        for (int j = 0; j < NC; j++)
            vv[j] = load16(v + t * vstride + (size_t)16 * j * (bf16 ? 2 : 4), bf16);
        for (int g = 0; g < NG; g++) {
            const __m512 pg = _mm512_set1_ps(p[g * MAX_BS + t]);
            for (int j = 0; j < NC; j++)
                a[g][j] = _mm512_fmadd_ps(pg, vv[j], a[g][j]);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int j = 0; j < NC; j++)
            _mm512_storeu_ps(acc + g * MAX_D + 16 * j, a[g][j]);
}

/* pv_tile with compile-time NG, NC: the accumulators stay in registers. */
INLINE void pv_dispatch(float *acc, const float *corr, const float *p, const char *v, size_t vstride,
                        int n, int NG, int NC, int bf16) {
#define PV_CASE(ng, nc) case (ng) * 8 + (nc): pv_tile(acc, corr, p, v, vstride, n, ng, nc, bf16); break;
    switch (NG * 8 + NC) {
    PV_CASE(1, 1) PV_CASE(2, 1) PV_CASE(3, 1) PV_CASE(4, 1)
    PV_CASE(1, 4) PV_CASE(2, 4) PV_CASE(3, 4) PV_CASE(4, 4)
    }
#undef PV_CASE
}

#if BF16_DOT
/* P.V for bf16 caches by vdpbf16ps: two V rows interleaved per 32-dim chunk (unpacklo/hi_epi16)
 * against a broadcast pair of bf16 probabilities, so one instruction does 2 tokens x 16 dims
 * (fp32 FMAs on widened rows did 1 x 16). The accumulators keep unpack's lane order: within
 * each 32-dim chunk, slots 0-15 hold dims 8(j/4) + j%4 and slots 16-31 dims 8(j/4) + 4 + j%4;
 * decode_task undoes that when it writes the output. pp[g][i] is the bf16 pair (p[2i], p[2i+1]).
 * A missing odd row is a zero vector, never a load past the block's last token. */
INLINE void pv_bf16_tile(float *acc, const float *corr, const uint32_t *pp, const char *v, size_t vstride,
                         int n, int NG, int NCH) {
    __m512 a[4][4];
    for (int g = 0; g < NG; g++)
        for (int k = 0; k < 2 * NCH; k++)
            a[g][k] = _mm512_mul_ps(_mm512_loadu_ps(acc + g * MAX_D + 16 * k), _mm512_set1_ps(corr[g]));
    for (int t = 0; t < n; t += 2) {
        __m512i lo[2], hi[2];
        for (int ch = 0; ch < NCH; ch++) {
            const __m512i x = _mm512_loadu_si512(v + t * vstride + 64 * ch);
            const __m512i y = t + 1 < n ? _mm512_loadu_si512(v + (t + 1) * vstride + 64 * ch)
                                        : _mm512_setzero_si512();
            lo[ch] = _mm512_unpacklo_epi16(x, y);
            hi[ch] = _mm512_unpackhi_epi16(x, y);
        }
        for (int g = 0; g < NG; g++) {
            const __m512bh pb = (__m512bh)_mm512_set1_epi32((int)pp[g * (MAX_BS / 2) + t / 2]);
            for (int ch = 0; ch < NCH; ch++) {
                a[g][2 * ch] = _mm512_dpbf16_ps(a[g][2 * ch], (__m512bh)lo[ch], pb);
                a[g][2 * ch + 1] = _mm512_dpbf16_ps(a[g][2 * ch + 1], (__m512bh)hi[ch], pb);
            }
        }
    }
    for (int g = 0; g < NG; g++)
        for (int k = 0; k < 2 * NCH; k++)
            _mm512_storeu_ps(acc + g * MAX_D + 16 * k, a[g][k]);
}

INLINE void pv_bf16_dispatch(float *acc, const float *corr, const uint32_t *pp, const char *v, size_t vstride,
                             int n, int NG, int NCH) {
#define PVB_CASE(ng, nch) case (ng) * 8 + (nch): pv_bf16_tile(acc, corr, pp, v, vstride, n, ng, nch); break;
    switch (NG * 8 + NCH) {
    PVB_CASE(1, 1) PVB_CASE(2, 1) PVB_CASE(3, 1) PVB_CASE(4, 1)
    PVB_CASE(1, 2) PVB_CASE(2, 2) PVB_CASE(3, 2) PVB_CASE(4, 2)
    }
#undef PVB_CASE
}
#endif

/* Start moving block number b of a sequence (if it has one) into L2: blocks are scattered in
 * memory, so the hardware prefetcher cannot run ahead across them. */
INLINE void prefetch_block(const void *kc, const void *vc, const int32_t *table, int b, int L, int h,
                           int Hkv, int D, int BS, size_t esz) {
    const size_t rstride = (size_t)Hkv * D * esz;
    if (b * BS >= L)
        return;
    const size_t row0 = ((size_t)table[b] * BS * Hkv + h) * D * esz;
    for (int t = 0; t < BS && b * BS + t < L; t++)
        for (size_t off = 0; off < D * esz; off += 64) {
            _mm_prefetch((const char *)kc + row0 + t * rstride + off, _MM_HINT_T1);
            _mm_prefetch((const char *)vc + row0 + t * rstride + off, _MM_HINT_T1);
        }
}

/* One (sequence s, KV head h) task: all G query heads of h over the sequence's blocks. D and
 * bf16 are compile-time constants at every call site, so the loops over D unroll. */
INLINE void decode_task(const float *restrict q, const void *kc, const void *vc,
                        const int32_t *restrict tables, const int32_t *restrict lens,
                        float *restrict out, int s, int h, int Hq, int Hkv, int D, int BS, int MB,
                        float scale, int window, int bf16) {
    const int G = Hq / Hkv;
    const size_t esz = bf16 ? 2 : 4;
    const size_t rstride = (size_t)Hkv * D * esz;  /* bytes between a head's consecutive tokens */
    const int qvecs = (bf16 && BF16_DOT) ? D / 32 : D / 16;
    __m512 qv[MAX_G][MAX_D / 16];
    float acc[MAX_G][MAX_D] __attribute__((aligned(64)));
    float sc[MAX_G][MAX_BS] __attribute__((aligned(64)));
    /* running max, sum, rescale factor and block max per head, updated as one vector over all
     * MAX_G lanes; -1e30, not -inf, so the first rescale is a tiny factor on zeros, never NaN */
    float m[MAX_G], l[MAX_G], corr[MAX_G], bm[MAX_G];
    const int L = lens[s];
    const int start = (window > 0 && L > window) ? L - window : 0;
    for (int g = 0; g < MAX_G; g++)
        m[g] = bm[g] = -1e30f;
    for (int g = 0; g < G; g++) {
        const float *qp = q + ((size_t)s * Hq + (size_t)h * G + g) * D;
        for (int c = 0; c < qvecs; c++) {
#if BF16_DOT
            if (bf16) {  /* exact: q already holds bf16 values */
                qv[g][c] = (__m512)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(qp + 32 * c + 16),
                                                       _mm512_loadu_ps(qp + 32 * c));
                continue;
            }
#endif
            qv[g][c] = _mm512_loadu_ps(qp + 16 * c);
        }
        memset(acc[g], 0, sizeof(float) * D);
        l[g] = 0.f;
    }
    for (int b = 1; b < PF_BLOCKS; b++)  /* the loop below fetches PF_BLOCKS ahead of itself */
        prefetch_block(kc, vc, tables + (size_t)s * MB, start / BS + b, L, h, Hkv, D, BS, esz);
    for (int b0 = start - start % BS; b0 < L; b0 += BS) {
        const int blk = tables[(size_t)s * MB + b0 / BS];
        const int lo = b0 < start ? start - b0 : 0;
        const int n = ((L - b0) < BS ? (L - b0) : BS) - lo;
        const size_t row0 = (((size_t)blk * BS + lo) * Hkv + h) * D * esz;
        const char *kb = (const char *)kc + row0, *vb = (const char *)vc + row0;
        /* block PF_BLOCKS ahead, prefetched a tile's rows at a time between the dot products:
         * one burst per block stalled the loads behind it (6% slower on 2 threads, 12% on 1) */
        const int pfb = b0 / BS + PF_BLOCKS;
        const int pfn = pfb * BS < L ? ((L - pfb * BS) < BS ? (L - pfb * BS) : BS) : 0;
        const size_t prow0 = pfn ? ((size_t)tables[(size_t)s * MB + pfb] * BS * Hkv + h) * D * esz : 0;
        for (int t0 = 0; t0 < n; t0 += 16) {
            const int cnt = n - t0 < 16 ? n - t0 : 16;
            const __mmask16 valid = (__mmask16)((1u << cnt) - 1);
            const char *rows[16];
            for (int j = 0; j < 16; j++)  /* a partial tile re-reads its last row, never past it */
                rows[j] = kb + (size_t)(t0 + (j < cnt ? j : cnt - 1)) * rstride;
            for (int j = t0; j < t0 + 16 && j < pfn; j++)
                for (size_t off = 0; off < D * esz; off += 64) {
                    _mm_prefetch((const char *)kc + prow0 + j * rstride + off, _MM_HINT_T1);
                    _mm_prefetch((const char *)vc + prow0 + j * rstride + off, _MM_HINT_T1);
                }
            for (int g = 0; g < G; g++) {
                __m512 part[16];
                for (int j = 0; j < 16; j++)
                    part[j] = dot_partial(qv[g], rows[j], D, bf16);
                const __m512 sv = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid, hsum16x16(part),
                                                     _mm512_set1_ps(scale));
                _mm512_store_ps(sc[g] + t0, sv);
                const float tmax = _mm512_reduce_max_ps(sv);
                bm[g] = (t0 == 0 || tmax > bm[g]) ? tmax : bm[g];
            }
        }
        const __m512 m_old = _mm512_loadu_ps(m);
        const __m512 m_new = _mm512_max_ps(m_old, _mm512_loadu_ps(bm));
        _mm512_storeu_ps(corr, exp16(_mm512_sub_ps(m_old, m_new)));
        _mm512_storeu_ps(m, m_new);
        for (int g = 0; g < G; g++) {
            __m512 sum = _mm512_setzero_ps();
            for (int t0 = 0; t0 < n; t0 += 16) {
                const int cnt = n - t0 < 16 ? n - t0 : 16;
                const __m512 x = _mm512_sub_ps(_mm512_load_ps(sc[g] + t0), _mm512_set1_ps(m[g]));
                const __m512 p = _mm512_maskz_mov_ps((__mmask16)((1u << cnt) - 1), exp16(x));
                _mm512_store_ps(sc[g] + t0, p);
                sum = _mm512_add_ps(sum, p);
            }
            l[g] = l[g] * corr[g] + _mm512_reduce_add_ps(sum);
        }
#if BF16_DOT
        if (bf16) {
            uint32_t pp[MAX_G][MAX_BS / 2] __attribute__((aligned(64)));
            for (int g = 0; g < G; g++)
                for (int t0 = 0; t0 < n; t0 += 16)  /* lanes past n hold p = 0: pairs stay exact */
                    _mm256_store_si256((__m256i *)&pp[g][t0 / 2],
                                       (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(sc[g] + t0)));
            for (int c = 0; c < D;) {
                const int nch = D - c >= 64 ? 2 : 1;
                for (int g = 0; g < G; g += 4)
                    pv_bf16_dispatch(&acc[g][c], corr + g, pp[g], vb + c * esz, rstride, n,
                                     G - g < 4 ? G - g : 4, nch);
                c += 32 * nch;
            }
            continue;
        }
#endif
        for (int c = 0; c < D;) {
            const int nc = D - c >= 64 ? 4 : 1;
            for (int g = 0; g < G; g += 4)
                pv_dispatch(&acc[g][c], corr + g, sc[g], vb + c * esz, rstride, n,
                            G - g < 4 ? G - g : 4, nc, bf16);
            c += 16 * nc;
        }
    }
    for (int g = 0; g < G; g++) {
        float *op = out + ((size_t)s * Hq + (size_t)h * G + g) * D;
        const float invs = l[g] > 0.f ? 1.f / l[g] : 0.f;
#if BF16_DOT
        if (bf16) {  /* undo pv_bf16_tile's lane order */
            for (int c = 0; c < D; c += 32)
                for (int j = 0; j < 16; j++) {
                    op[c + 8 * (j / 4) + j % 4] = acc[g][c + j] * invs;
                    op[c + 8 * (j / 4) + 4 + j % 4] = acc[g][c + 16 + j] * invs;
                }
            continue;
        }
#endif
        const __m512 inv = _mm512_set1_ps(invs);
        for (int c = 0; c < D; c += 16)
            _mm512_storeu_ps(op + c, _mm512_mul_ps(_mm512_load_ps(&acc[g][c]), inv));
    }
}
#endif

/* ---- vec8 kernel: every build, for the head dims the AVX-512 kernel does not take --------------
 * Same plan in vec8.h's 8-lane vectors (AVX2, SSE2 or NEON registers). Per block and group of up
 * to 4 heads: each K row is loaded (and widened) once for the group's partial dot products, 8
 * keys' partials become 8 scores in one transpose-and-add; the softmax update runs for 8 heads
 * per vector; P.V keeps 8-12 accumulators (heads x dims) in registers for each V row loaded,
 * enough independent FMA chains to cover their latency. */
#include "vec8.h"
#include "vec8_attention.h"

#define V8_NG (V8_NARROW ? 2 : 4) /* heads per group: the scores keep 2 accumulators per head */

/* Lane j of the result is the sum of the 8 lanes of a[j]. The shuffles stay within 128-bit
 * halves until the last step: unpcklps/unpckhps, unpcklpd/unpckhpd, then vperm2f128 on AVX. */
INLINE v8f hsum8x8(const v8f a[8]) {
    const v8i lo = {0, 8, 1, 9, 4, 12, 5, 13}, hi = {2, 10, 3, 11, 6, 14, 7, 15};
    const v8i lo2 = {0, 1, 8, 9, 4, 5, 12, 13}, hi2 = {2, 3, 10, 11, 6, 7, 14, 15};
    const v8i lo4 = {0, 1, 2, 3, 8, 9, 10, 11}, hi4 = {4, 5, 6, 7, 12, 13, 14, 15};
    v8f b[4], c[2];
    for (int i = 0; i < 4; i++) /* halves of [x0+x2, y0+y2, x1+x3, y1+y3] for x, y = a[2i], a[2i+1] */
        b[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi);
    for (int i = 0; i < 2; i++) /* halves of the 4-lane sums of a[4i .. 4i+3] */
        c[i] = __builtin_shuffle(b[2 * i], b[2 * i + 1], lo2) + __builtin_shuffle(b[2 * i], b[2 * i + 1], hi2);
    return __builtin_shuffle(c[0], c[1], lo4) + __builtin_shuffle(c[0], c[1], hi4);
}

/* Scores of NG heads (q times scale in qs rows MAX_D apart) against the block's n K rows from kb,
 * rstride bytes apart, into sc (rows MAX_BS apart; lanes past n are -inf); bm[g] = their max.
 * Two keys at a time: per 8 dims, 2 K loads and NG q loads feed 2 NG FMAs. Between tiles, the
 * next 8 of the pfn K and V rows at pk, pv (a block ahead) are prefetched: one burst per block
 * fills the load queue and stalls the loads behind it. */
INLINE void scores8(const float *qs, const char *kb, size_t rstride, int n, int D, int NG, int bf16, float *sc,
                    float *bm, const char *pk, const char *pv, int pfn) {
    const size_t rbytes = (size_t)D * (bf16 ? 2 : 4);
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    v8f mx[4];
    for (int g = 0; g < NG; g++)
        mx[g] = v8_set1(-INFINITY);
    for (int t0 = 0; t0 < n; t0 += 8) {
        const int cnt = n - t0 < 8 ? n - t0 : 8;
        for (int t = t0; t < (t0 + 8 < n ? t0 + 8 : pfn) && t < pfn; t++) /* the last tile: the rest */
            for (size_t off = 0; off < rbytes; off += 64) {
                __builtin_prefetch(pk + t * rstride + off, 0, 2);
                __builtin_prefetch(pv + t * rstride + off, 0, 2);
            }
        v8f part[4][8];
        for (int j = 0; j < 8; j += 2) { /* a partial tile re-reads its last row, never past it */
            const char *k0 = kb + (size_t)(t0 + (j < cnt ? j : cnt - 1)) * rstride;
            const char *k1 = kb + (size_t)(t0 + (j + 1 < cnt ? j + 1 : cnt - 1)) * rstride;
            v8acc a[4][2];
            for (int g = 0; g < NG; g++)
                a[g][0] = a[g][1] = v8acc_of(v8_zero());
            for (int c = 0; c < D; c += 8) {
                v8f x = v8_load_kv(k0, c, bf16), y = v8_load_kv(k1, c, bf16);
                V8_IN_REG(x);
                V8_IN_REG(y);
                for (int g = 0; g < NG; g++) {
                    const v8f qv = v8_load(qs + g * MAX_D + c);
                    a[g][0] = v8acc_fma(a[g][0], qv, x);
                    a[g][1] = v8acc_fma(a[g][1], qv, y);
                }
            }
            for (int g = 0; g < NG; g++) {
                part[g][j] = v8acc_get(a[g][0]);
                part[g][j + 1] = v8acc_get(a[g][1]);
            }
        }
        for (int g = 0; g < NG; g++) {
            const v8f sv = v8_select(lane < cnt, hsum8x8(part[g]), v8_set1(-INFINITY));
            v8_store(sc + g * MAX_BS + t0, sv);
            mx[g] = v8_max(mx[g], sv);
        }
    }
    for (int g = 0; g < NG; g++)
        bm[g] = v8_hmax(mx[g]);
}

/* acc[g][c ..] = acc * corr[g] + sum over the block's n tokens of p[g][t] V[t][c ..], for NG
 * heads and NC vectors of dims: each V vector is loaded once for the NG heads. */
INLINE void pv8_tile(float *acc, const float *corr, const float *p, const char *v, size_t vstride, int n,
                     int NG, int NC, int bf16) {
    v8acc a[4][8];
    for (int g = 0; g < NG; g++)
        for (int j = 0; j < NC; j++)
            a[g][j] = v8acc_of(v8_load(acc + g * MAX_D + 8 * j) * corr[g]);
    for (int t = 0; t < n; t++) {
        v8f pg[4];
        for (int g = 0; g < NG; g++)
            pg[g] = v8_set1(p[g * MAX_BS + t]);
        for (int j = 0; j < NC; j++) {
            v8f x = v8_load_kv(v + t * vstride, 8 * j, bf16);
            V8_IN_REG(x);
            for (int g = 0; g < NG; g++)
                a[g][j] = v8acc_fma(a[g][j], pg[g], x);
        }
    }
    for (int g = 0; g < NG; g++)
        for (int j = 0; j < NC; j++)
            v8_store(acc + g * MAX_D + 8 * j, v8acc_get(a[g][j]));
}

/* scores8 with a compile-time NG: the accumulators stay in registers. The switch sits outside the
 * loops: inside them, GCC hoisted the K loads all cases share above it and spilled them. */
INLINE void scores8_dispatch(const float *qs, const char *kb, size_t rstride, int n, int D, int NG, int bf16,
                             float *sc, float *bm, const char *pk, const char *pv, int pfn) {
    switch (NG) {
    case 1: scores8(qs, kb, rstride, n, D, 1, bf16, sc, bm, pk, pv, pfn); break;
    case 2: scores8(qs, kb, rstride, n, D, 2, bf16, sc, bm, pk, pv, pfn); break;
    case 3: scores8(qs, kb, rstride, n, D, 3, bf16, sc, bm, pk, pv, pfn); break;
    case 4: scores8(qs, kb, rstride, n, D, 4, bf16, sc, bm, pk, pv, pfn); break;
    }
}

/* P.V of NG heads over all D dims, in passes of NC vectors of dims (compile-time NG, NC): NG x NC
 * = 8 or 12 accumulators where D allows, fewer for the last dims. */
INLINE void pv8_heads(float *acc, const float *corr, const float *p, const char *v, size_t vstride, int n, int D,
                      int NG, int bf16) {
    const size_t esz = bf16 ? 2 : 4;
#define PV8_CASE(ng, nc) case (ng) * 16 + (nc): pv8_tile(acc + c, corr, p, v + c * esz, vstride, n, ng, nc, bf16); break;
    for (int c = 0; c < D;) {
        const int widest = V8_NARROW ? 4 / NG : NG == 1 ? 8 : NG == 4 ? 2 : 4; /* 8 or 12 accumulators, 4 */
        const int nc = (D - c) / 8 >= widest ? widest : (D - c) / 8 >= 2 ? 2 : 1;
        switch (NG * 16 + nc) {
        PV8_CASE(1, 8) PV8_CASE(1, 4) PV8_CASE(1, 2) PV8_CASE(1, 1)
        PV8_CASE(2, 4) PV8_CASE(2, 2) PV8_CASE(2, 1)
        PV8_CASE(3, 4) PV8_CASE(3, 2) PV8_CASE(3, 1)
        PV8_CASE(4, 2) PV8_CASE(4, 1)
        }
        c += 8 * nc;
    }
#undef PV8_CASE
}

/* Rows of block b (if the sequence has it) towards L2, K and V. */
INLINE void prefetch_block8(const void *kc, const void *vc, const int32_t *table, int b, int L, int h, int Hkv,
                            int D, int BS, size_t esz) {
    if (b * BS >= L)
        return;
    const size_t rstride = (size_t)Hkv * D * esz;
    const size_t row0 = ((size_t)table[b] * BS * Hkv + h) * D * esz;
    for (int t = 0; t < BS && b * BS + t < L; t++)
        for (size_t off = 0; off < D * esz; off += 64) {
            __builtin_prefetch((const char *)kc + row0 + t * rstride + off, 0, 2);
            __builtin_prefetch((const char *)vc + row0 + t * rstride + off, 0, 2);
        }
}

/* One (sequence s, KV head h) task, as decode_task. */
INLINE void decode_task8(const float *restrict q, const void *kc, const void *vc, const int32_t *restrict tables,
                         const int32_t *restrict lens, float *restrict out, int s, int h, int Hq, int Hkv, int D,
                         int BS, int MB, float scale, int window, int bf16) {
    const int G = Hq / Hkv;
    const size_t esz = bf16 ? 2 : 4;
    const size_t rstride = (size_t)Hkv * D * esz; /* bytes between a head's consecutive tokens */
    const int32_t *table = tables + (size_t)s * MB;
    float qs[MAX_G][MAX_D] __attribute__((aligned(32)));  /* q times scale */
    float acc[MAX_G][MAX_D] __attribute__((aligned(32)));
    float sc[MAX_G][MAX_BS] __attribute__((aligned(32)));
    /* running max, sum, rescale factor and block max per head, updated 8 heads per vector;
     * -1e30, not -inf, so the first rescale is a tiny factor on zeros, never NaN */
    float m[MAX_G], l[MAX_G], corr[MAX_G], bm[MAX_G];
    const int L = lens[s];
    const int start = (window > 0 && L > window) ? L - window : 0;
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int g = 0; g < MAX_G; g++) {
        m[g] = bm[g] = -1e30f;
        l[g] = 0.f;
    }
    for (int g = 0; g < G; g++) {
        const float *qp = q + ((size_t)s * Hq + (size_t)h * G + g) * D;
        for (int c = 0; c < D; c += 8) {
            v8_store(&qs[g][c], v8_load(qp + c) * scale);
            v8_store(&acc[g][c], v8_zero());
        }
    }
    for (int b = 0; b < PF_BLOCKS; b++) /* the loop below fetches PF_BLOCKS ahead of itself */
        prefetch_block8(kc, vc, table, start / BS + b, L, h, Hkv, D, BS, esz);
    for (int b0 = start - start % BS; b0 < L; b0 += BS) {
        const int blk = table[b0 / BS];
        const int lo = b0 < start ? start - b0 : 0;
        const int n = ((L - b0) < BS ? (L - b0) : BS) - lo;
        const size_t row0 = (((size_t)blk * BS + lo) * Hkv + h) * D * esz;
        const char *kb = (const char *)kc + row0, *vb = (const char *)vc + row0;
        const int pfb = b0 / BS + PF_BLOCKS; /* the block to prefetch, if the sequence has it */
        const int pfn = pfb * BS < L ? ((L - pfb * BS) < BS ? (L - pfb * BS) : BS) : 0;
        const size_t prow0 = pfn ? ((size_t)table[pfb] * BS * Hkv + h) * D * esz : 0;
        for (int g = 0; g < G; g += V8_NG) /* the first head group prefetches */
            scores8_dispatch(qs[g], kb, rstride, n, D, G - g < V8_NG ? G - g : V8_NG, bf16, sc[g], bm + g,
                             (const char *)kc + prow0, (const char *)vc + prow0, g ? 0 : pfn);
        for (int g = 0; g < G; g += 8) {
            const v8f m_old = v8_load(m + g), m_new = v8_max(m_old, v8_load(bm + g));
            v8_store(corr + g, v8_exp(m_old - m_new));
            v8_store(m + g, m_new);
        }
        for (int g = 0; g < G; g++) {
            v8f sum = v8_zero();
            for (int t0 = 0; t0 < n; t0 += 8) { /* lanes past n: p = 0, not exp's clamped 1e-38 */
                const v8f p = v8_select(lane < n - t0, v8_exp(v8_load(&sc[g][t0]) - m[g]), v8_zero());
                v8_store(&sc[g][t0], p);
                sum += p;
            }
            l[g] = l[g] * corr[g] + v8_hsum(sum);
        }
        for (int g = 0; g < G; g += V8_NG)
            pv8_heads(acc[g], corr + g, sc[g], vb, rstride, n, D, G - g < V8_NG ? G - g : V8_NG, bf16);
    }
    for (int g = 0; g < G; g++) {
        float *op = out + ((size_t)s * Hq + (size_t)h * G + g) * D;
        const v8f inv = v8_set1(l[g] > 0.f ? 1.f / l[g] : 0.f);
        for (int c = 0; c < D; c += 8)
            v8_store(op + c, v8_load(&acc[g][c]) * inv);
    }
}

#define DECODE_ARGS const float *restrict q, const void *kc, const void *vc, \
    const int32_t *restrict tables, const int32_t *restrict lens, float *restrict out, int S, \
    int Hq, int Hkv, int D, int BS, int MB, float scale, int window, int nthreads
/* The parallel loop sits here, not inside decode_task: GCC outlines an OpenMP region before it
 * inlines, so only literal arguments in the region body reach the task as constants. */
#define DECODE_LOOP(TASK, DC, BF) do {                                                                \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(nthreads)")          \
    for (int s = 0; s < S; s++)                                                                 \
        for (int h = 0; h < Hkv; h++)                                                           \
            TASK(q, kc, vc, tables, lens, out, s, h, Hq, Hkv, DC, BS, MB, scale, window, BF);     \
    } while (0)

static void decode_bf16(DECODE_ARGS) {
#if defined(__AVX512F__)
    if (D == 64) { DECODE_LOOP(decode_task, 64, 1); return; }
    if (D == 128) { DECODE_LOOP(decode_task, 128, 1); return; }
    if (D % (BF16_DOT ? 32 : 16) == 0) { DECODE_LOOP(decode_task, D, 1); return; }
#else
    if (D == 64) { DECODE_LOOP(decode_task8, 64, 1); return; }
    if (D == 128) { DECODE_LOOP(decode_task8, 128, 1); return; }
#endif
    if (D % 8 == 0) { DECODE_LOOP(decode_task8, D, 1); return; }
    decode_portable_bf16(q, kc, vc, tables, lens, out, S, Hq, Hkv, D, BS, MB, scale, window, nthreads);
}

static void decode_f32(DECODE_ARGS) {
#if defined(__AVX512F__)
    if (D == 64) { DECODE_LOOP(decode_task, 64, 0); return; }
    if (D == 128) { DECODE_LOOP(decode_task, 128, 0); return; }
    if (D % 16 == 0) { DECODE_LOOP(decode_task, D, 0); return; }
#else
    if (D == 64) { DECODE_LOOP(decode_task8, 64, 0); return; }
    if (D == 128) { DECODE_LOOP(decode_task8, 128, 0); return; }
#endif
    if (D % 8 == 0) { DECODE_LOOP(decode_task8, D, 0); return; }
    decode_portable_f32(q, kc, vc, tables, lens, out, S, Hq, Hkv, D, BS, MB, scale, window, nthreads);
}

/* Entry points. io_bf16 = 0: q and out are fp32 (q already rounded to the cache dtype);
 * io_bf16 = 1: q and out are bf16 [S, Hq, D], widened and rounded here so the caller needs no
 * conversion ops around the call. Returns 0, or -1 if the fp32 staging buffers cannot be had. */
typedef void (*decode_fn)(DECODE_ARGS);
static int decode_io(decode_fn fn, const void *q, const void *kc, const void *vc, const int32_t *tables,
                     const int32_t *lens, void *out, int S, int Hq, int Hkv, int D, int BS, int MB,
                     float scale, int window, int nthreads, int io_bf16) {
    if (!io_bf16) {
        fn(q, kc, vc, tables, lens, out, S, Hq, Hkv, D, BS, MB, scale, window, nthreads);
        return 0;
    }
    const size_t n = (size_t)S * Hq * D;
    float *qf = malloc(n * sizeof(float)), *of = malloc(n * sizeof(float));
    if (!qf || !of) {
        free(qf);
        free(of);
        return -1;
    }
    for (size_t i = 0; i < n; i++)
        qf[i] = bf16_to_f32(((const uint16_t *)q)[i]);
    fn(qf, kc, vc, tables, lens, of, S, Hq, Hkv, D, BS, MB, scale, window, nthreads);
    for (size_t i = 0; i < n; i++)
        ((uint16_t *)out)[i] = to_bf16_bits(of[i]);
    free(qf);
    free(of);
    return 0;
}

#define DECODE_IO_ARGS const void *q, const void *kc, const void *vc, const int32_t *tables, \
    const int32_t *lens, void *out, int S, int Hq, int Hkv, int D, int BS, int MB, float scale, \
    int window, int nthreads, int io_bf16
int paged_decode_bf16(DECODE_IO_ARGS) {
    return decode_io(decode_bf16, q, kc, vc, tables, lens, out, S, Hq, Hkv, D, BS, MB, scale, window,
                     nthreads, io_bf16);
}

int paged_decode_f32(DECODE_IO_ARGS) {
    return decode_io(decode_f32, q, kc, vc, tables, lens, out, S, Hq, Hkv, D, BS, MB, scale, window,
                     nthreads, io_bf16);
}

int baton_cpu_abi_version(void) { return 3; }
