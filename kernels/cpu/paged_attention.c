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
 * With AVX-512 (and D % 16 == 0; bf16 also D % 32 == 0 when AVX512_BF16 does the dots) a
 * vector kernel runs; otherwise the portable loop below.
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

#if defined(__AVX512F__)
#define INLINE static inline __attribute__((always_inline))
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

#define DECODE_ARGS const float *restrict q, const void *kc, const void *vc, \
    const int32_t *restrict tables, const int32_t *restrict lens, float *restrict out, int S, \
    int Hq, int Hkv, int D, int BS, int MB, float scale, int window, int nthreads
/* The parallel loop sits here, not inside decode_task: GCC outlines an OpenMP region before it
 * inlines, so only literal arguments in the region body reach the task as constants. */
#define DECODE_LOOP(DC, BF) do {                                                                \
    _Pragma("omp parallel for collapse(2) schedule(dynamic, 1) num_threads(nthreads)")          \
    for (int s = 0; s < S; s++)                                                                 \
        for (int h = 0; h < Hkv; h++)                                                           \
            decode_task(q, kc, vc, tables, lens, out, s, h, Hq, Hkv, DC, BS, MB, scale, window, BF); \
    } while (0)

static void decode_bf16(DECODE_ARGS) {
#if defined(__AVX512F__)
    if (D == 64) { DECODE_LOOP(64, 1); return; }
    if (D == 128) { DECODE_LOOP(128, 1); return; }
    if (D % (BF16_DOT ? 32 : 16) == 0) { DECODE_LOOP(D, 1); return; }
#endif
    decode_portable_bf16(q, kc, vc, tables, lens, out, S, Hq, Hkv, D, BS, MB, scale, window, nthreads);
}

static void decode_f32(DECODE_ARGS) {
#if defined(__AVX512F__)
    if (D == 64) { DECODE_LOOP(64, 0); return; }
    if (D == 128) { DECODE_LOOP(128, 0); return; }
    if (D % 16 == 0) { DECODE_LOOP(D, 0); return; }
#endif
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
