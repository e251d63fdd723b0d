/* Causal prefill attention for CPUs over the paged KV cache, bf16 (AVX512_BF16), flash style:
 * q.k by vdpbf16ps (exact bf16 products, fp32 sums), online softmax in fp32, P.V by vdpbf16ps
 * on bf16-rounded probabilities (as GPU flash kernels do) with fp32 accumulation.
 *
 * A task is (sequence s, KV head h, a chunk of QCHUNK query positions). It first copies the
 * keys its chunk can see into a VNNI tile layout (16 keys x D/2 bf16 pairs, so one vdpbf16ps
 * scores 16 keys on one pair of dims) and the values into key pairs (each 32-bit word holds
 * one dim of two consecutive keys, so one vdpbf16ps adds two keys' share to 16 output dims);
 * both stay in L2 while the chunk's G query heads x QCHUNK positions sweep them, 4 rows at a
 * time with the rows' output accumulators in registers. torch's CPU flash attention runs these shapes (GQA, a few
 * hundred tokens, D = 64) at ~30 GFLOP/s per core; this is several times that.
 *
 * Contract of paged_prefill_bf16 (same as kernels.reference.paged_prefill_attention): q bf16
 * [T, Hq, D]; sequence s owns rows q_start[s]..q_start[s+1]-1, the last q_len of its
 * seq_lens[s] positions; caches [blocks, BS, Hkv, D] hold every position's K/V already;
 * tables [S, MB] int32; out fp32 [T, Hq, D]. Returns 0, or -1 when this build cannot run the
 * shape (no AVX512_BF16, D % 32 != 0, D > 256, Hq % Hkv != 0): the caller uses the reference.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define INLINE static inline __attribute__((always_inline))
#include "vexp.h"

#define QCHUNK 64 /* query positions per task: enough rows to amortise the K/V copy */
#define MAX_DV 16 /* D / 16 for D <= 256 */

typedef struct {
    int s, h, i0, i1; /* sequence, KV head, query rows [i0, i1) of the sequence's chunk */
} prefill_task;

/* Lane r (0..3) of the result is the max (or the sum) of the 16 lanes of a[r]: one shared
 * shuffle tree, 12 ops for the four rows instead of four separate 8-op reductions. */
INLINE __m128 reduce4(const __m512 a[4], int is_max) {
#define RED(x, y) (is_max ? _mm512_max_ps((x), (y)) : _mm512_add_ps((x), (y)))
    const __m512 t0 = RED(_mm512_unpacklo_ps(a[0], a[1]), _mm512_unpackhi_ps(a[0], a[1]));
    const __m512 t1 = RED(_mm512_unpacklo_ps(a[2], a[3]), _mm512_unpackhi_ps(a[2], a[3]));
    const __m512d d0 = _mm512_castps_pd(t0), d1 = _mm512_castps_pd(t1);
    const __m512 u = RED(_mm512_castpd_ps(_mm512_unpacklo_pd(d0, d1)), _mm512_castpd_ps(_mm512_unpackhi_pd(d0, d1)));
    const __m512 v = RED(u, _mm512_shuffle_f32x4(u, u, 0x4E));
    return _mm512_castps512_ps128(RED(v, _mm512_shuffle_f32x4(v, v, 0xB1)));
#undef RED
}

/* Rows r (< nr <= 4) of one head g at chunk positions i0+r; keys [0, n_keys) of the buffers.
 * qpos[r] is the absolute position of row r, lo[r] its first visible key. */
INLINE void rows4(const uint32_t *const qrow[4], const uint32_t *kv, const uint32_t *vp, int nr,
                  const int qpos[4], const int lo[4], float scale, int D, float *const orow[4]) {
    const int DV = D / 16, DP = D / 2;
    __m512 o[4][MAX_DV];
    /* running max and sum of the four rows, one lane each; -1e30, not -inf, so the first rescale
     * is exp(-huge) on zeros, never NaN */
    __m128 m4 = _mm_set1_ps(-1e30f), l4 = _mm_setzero_ps();
    uint32_t pp[4][8] __attribute__((aligned(64))); /* the tile's probabilities as bf16 key pairs */
    for (int r = 0; r < 4; r++)
        for (int c = 0; c < DV; c++)
            o[r][c] = _mm512_setzero_ps();
    int kmin = lo[0], kmax = qpos[0];
    for (int r = 1; r < nr; r++) {
        kmin = lo[r] < kmin ? lo[r] : kmin;
        kmax = qpos[r] > kmax ? qpos[r] : kmax;
    }
    for (int t0 = kmin - kmin % 16; t0 <= kmax; t0 += 16) {
        const uint32_t *tile = kv + (size_t)(t0 / 16) * DP * 16;
        __m512 sc[4];
        for (int r = 0; r < 4; r++)
            sc[r] = _mm512_setzero_ps();
        for (int pi = 0; pi < DP; pi++) {
            const __m512bh kp = (__m512bh)_mm512_load_si512(tile + (size_t)pi * 16);
            for (int r = 0; r < 4; r++)
                if (r < nr)
                    sc[r] = _mm512_dpbf16_ps(sc[r], (__m512bh)_mm512_set1_epi32((int)qrow[r][pi]), kp);
        }
        const __m512i kidx = _mm512_add_epi32(_mm512_set1_epi32(t0),
                                              _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
        /* the four rows' softmax state moves as one vector: shared reductions, one exp for the
         * rescale factors (a libm expf here would spill every live accumulator around the call).
         * Rows past nr repeat row nr-1: computed, never stored. */
        __m512 sv[4], pv[4];
        __mmask16 ok[4];
        for (int r = 0; r < 4; r++) {
            ok[r] = _mm512_cmple_epi32_mask(kidx, _mm512_set1_epi32(qpos[r])) &
                    _mm512_cmpge_epi32_mask(kidx, _mm512_set1_epi32(lo[r]));
            sv[r] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), ok[r], sc[r], _mm512_set1_ps(scale));
        }
        const __m128 mnew4 = _mm_max_ps(m4, reduce4(sv, 1));
        const __m128 corr4 = _mm512_castps512_ps128(exp16(_mm512_castps128_ps512(_mm_sub_ps(m4, mnew4))));
        float mnew[4] __attribute__((aligned(16))), cf[4] __attribute__((aligned(16)));
        _mm_store_ps(mnew, mnew4);
        _mm_store_ps(cf, corr4);
        __m512 corr[4];
        for (int r = 0; r < 4; r++) {
            pv[r] = _mm512_maskz_mov_ps(ok[r], exp16(_mm512_sub_ps(sv[r], _mm512_set1_ps(mnew[r]))));
            _mm256_store_si256((__m256i *)pp[r], (__m256i)_mm512_cvtneps_pbh(pv[r]));
            corr[r] = _mm512_set1_ps(cf[r]);
        }
        l4 = _mm_add_ps(_mm_mul_ps(l4, corr4), reduce4(pv, 0));
        m4 = mnew4;
        for (int r = 0; r < nr; r++)
            for (int c = 0; c < DV; c++)
                o[r][c] = _mm512_mul_ps(o[r][c], corr[r]);
        const int tend = kmax - t0 + 1 < 16 ? kmax - t0 + 1 : 16;
        for (int j = 0; j < (tend + 1) / 2; j++) {  /* a pair past the keys holds zeros, p = 0 */
            const uint32_t *vpair = vp + (size_t)(t0 / 2 + j) * D;
            __m512bh pj[4];
            for (int r = 0; r < 4; r++)
                pj[r] = (__m512bh)_mm512_set1_epi32((int)pp[r][j]);
            for (int c = 0; c < DV; c++) {
                const __m512bh v = (__m512bh)_mm512_load_si512(vpair + 16 * c);
                for (int r = 0; r < 4; r++)
                    if (r < nr)
                        o[r][c] = _mm512_dpbf16_ps(o[r][c], v, pj[r]);
            }
        }
    }
    float l[4] __attribute__((aligned(16)));
    _mm_store_ps(l, l4);
    for (int r = 0; r < nr; r++) {
        const __m512 inv = _mm512_set1_ps(l[r] > 0.f ? 1.f / l[r] : 0.f);
        for (int c = 0; c < DV; c++)
            _mm512_storeu_ps(orow[r] + 16 * c, _mm512_mul_ps(o[r][c], inv));
    }
}

INLINE void prefill_task_run(const uint16_t *q, const uint16_t *kc, const uint16_t *vc,
                             const int32_t *tables, const int32_t *lens, const int32_t *qstart,
                             float *out, prefill_task tk, int Hq, int Hkv, int D, int BS, int MB,
                             float scale, int window, uint32_t *kv, uint32_t *vp) {
    const int G = Hq / Hkv, DP = D / 2;
    const int L = lens[tk.s];
    const int q_len = qstart[tk.s + 1] - qstart[tk.s];
    const int base = L - q_len; /* absolute position of the chunk's first query */
    const int last = base + tk.i1 - 1;
    int first = 0;
    if (window > 0 && base + tk.i0 - window + 1 > 0)
        first = base + tk.i0 - window + 1;
    first -= first % 16;
    const int n_keys = last + 1 - first;
    const int n_tiles = (n_keys + 15) / 16;
    /* K -> VNNI tiles (tile, dim pair, key); V -> key pairs (pair, dim): the low half of each
     * word is the even key. Keys past `last` are zeros in both. */
    for (int kt = 0; kt < n_tiles; kt++) {
        uint32_t *tile = kv + (size_t)kt * DP * 16;
        for (int j = 0; j < 16; j++) {
            const int t = first + kt * 16 + j;
            uint32_t *vd = vp + (size_t)(kt * 8 + j / 2) * D;
            if (t > last) {
                for (int pi = 0; pi < DP; pi++)
                    tile[(size_t)pi * 16 + j] = 0;
                if (j % 2 == 0)
                    memset(vd, 0, sizeof(uint32_t) * D);
                continue;
            }
            const int blk = tables[(size_t)tk.s * MB + t / BS];
            const uint32_t *krow = (const uint32_t *)(kc + (((size_t)blk * BS + t % BS) * Hkv + tk.h) * D);
            const uint16_t *vrow = vc + (((size_t)blk * BS + t % BS) * Hkv + tk.h) * D;
            for (int pi = 0; pi < DP; pi++)
                tile[(size_t)pi * 16 + j] = krow[pi];
            for (int c = 0; c < D; c += 16) {
                const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vrow + c)));
                __m512i *dst = (__m512i *)(vd + c);
                _mm512_store_si512(dst, j % 2 ? _mm512_or_si512(_mm512_load_si512(dst), _mm512_slli_epi32(w, 16))
                                              : w);
            }
        }
    }
    for (int g = 0; g < G; g++) {
        for (int i = tk.i0; i < tk.i1; i += 4) {
            const int nr = tk.i1 - i < 4 ? tk.i1 - i : 4;
            const uint32_t *qrow[4];
            float *orow[4];
            int qpos[4], lo[4];
            for (int r = 0; r < 4; r++) {
                const int ii = i + (r < nr ? r : nr - 1);
                const size_t row = ((size_t)(qstart[tk.s] + ii) * Hq + (size_t)tk.h * G + g) * D;
                qrow[r] = (const uint32_t *)(q + row);
                orow[r] = out + row;
                qpos[r] = base + ii - first; /* positions relative to the buffers */
                const int l0 = window > 0 ? base + ii - window + 1 - first : 0;
                lo[r] = l0 > 0 ? l0 : 0;
            }
            rows4(qrow, kv, vp, nr, qpos, lo, scale, D, orow);
        }
    }
}
#endif

int paged_prefill_bf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *tables,
                       const int32_t *lens, const int32_t *qstart, float *out, int S, int Hq, int Hkv,
                       int D, int BS, int MB, float scale, int window, int nthreads) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (D % 32 || D > 256 || Hkv <= 0 || Hq % Hkv)
        return -1;
    int n = 0;
    for (int s = 0; s < S; s++)
        n += Hkv * ((qstart[s + 1] - qstart[s] + QCHUNK - 1) / QCHUNK);
    prefill_task *tasks = malloc(sizeof(prefill_task) * (size_t)(n > 0 ? n : 1));
    if (!tasks)
        return -1;
    int maxkeys = 16;
    n = 0;
    for (int s = 0; s < S; s++) {
        const int q_len = qstart[s + 1] - qstart[s];
        maxkeys = lens[s] + 16 > maxkeys ? lens[s] + 16 : maxkeys;
        for (int i0 = 0; i0 < q_len; i0 += QCHUNK)
            for (int h = 0; h < Hkv; h++)
                tasks[n++] = (prefill_task){s, h, i0, i0 + QCHUNK < q_len ? i0 + QCHUNK : q_len};
    }
    int failed = 0;
    _Pragma("omp parallel num_threads(nthreads)")
    {
        /* per-thread buffers sized for the longest context: K tiles and V key pairs (bf16 pairs) */
        uint32_t *kv = aligned_alloc(64, ((size_t)maxkeys * D * 2 + 63) / 64 * 64);
        uint32_t *vp = aligned_alloc(64, ((size_t)maxkeys * D * 2 + 63) / 64 * 64);
        if (!kv || !vp) {
            _Pragma("omp atomic write")
            failed = 1;
        }
        _Pragma("omp for schedule(dynamic, 1)")
        for (int i = 0; i < n; i++) {
            if (!kv || !vp)
                continue;
            if (D == 64)
                prefill_task_run(q, kc, vc, tables, lens, qstart, out, tasks[i], Hq, Hkv, 64, BS, MB,
                                 scale, window, kv, vp);
            else
                prefill_task_run(q, kc, vc, tables, lens, qstart, out, tasks[i], Hq, Hkv, D, BS, MB,
                                 scale, window, kv, vp);
        }
        free(kv);
        free(vp);
    }
    free(tasks);
    return failed ? -1 : 0;
#else
    (void)q; (void)kc; (void)vc; (void)tables; (void)lens; (void)qstart; (void)out; (void)S; (void)Hq;
    (void)Hkv; (void)D; (void)BS; (void)MB; (void)scale; (void)window; (void)nthreads;
    return -1;
#endif
}
