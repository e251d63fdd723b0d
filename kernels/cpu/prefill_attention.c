/* Causal prefill attention for CPUs over the paged KV cache, flash style (online softmax in
 * fp32). Two implementations:
 *
 * - bf16 caches with AVX512_BF16: q.k by vdpbf16ps (exact bf16 products, fp32 sums), P.V by
 *   vdpbf16ps on bf16-rounded probabilities (as GPU flash kernels do) with fp32 accumulation.
 *   A task is (sequence s, KV head h, a chunk of QCHUNK query positions). It first copies the
 *   keys its chunk can see into a VNNI tile layout (16 keys x D/2 bf16 pairs, so one vdpbf16ps
 *   scores 16 keys on one pair of dims) and the values into key pairs (each 32-bit word holds
 *   one dim of two consecutive keys, so one vdpbf16ps adds two keys' share to 16 output dims);
 *   both stay in L2 while the chunk's G query heads x QCHUNK positions sweep them, 4 rows at a
 *   time with the rows' output accumulators in registers. torch's CPU flash attention runs these
 *   shapes (GQA, a few hundred tokens, D = 64) at ~30 GFLOP/s per core; this is several times that.
 *
 * - Everything else (fp32 caches on every build, bf16 caches without AVX512_BF16): fp32 math in
 *   vec8.h's 8-lane vectors (AVX2, SSE2 or NEON registers), bf16 K/V widened exactly on load.
 *   See "vec8 path" below.
 *
 * Contract of paged_prefill_{bf16,f32} (same as kernels.reference.paged_prefill_attention):
 * q [T, Hq, D] in the cache dtype (bf16 bits or fp32); sequence s owns rows
 * q_start[s]..q_start[s+1]-1, the last q_len of its seq_lens[s] positions; caches
 * [blocks, BS, Hkv, D] hold every position's K/V already (other slots may hold anything, NaN
 * included, and table entries past a sequence are never read); tables [S, MB] int32; out fp32
 * [T, Hq, D]. Returns 0, or -1 for shapes no path takes (D % 8 != 0, D > 256, Hq % Hkv != 0) or
 * when memory runs out: the caller uses the reference. bf16 shapes the AVX512_BF16 kernel does
 * not take (D % 32 != 0) go to the vec8 path.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))

typedef struct {
    int s, h, i0, i1; /* sequence, KV head, query rows [i0, i1) of the sequence's chunk */
} prefill_task;

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#include "vexp.h"

#define QCHUNK 64 /* query positions per task: enough rows to amortise the K/V copy */
#define MAX_DV 16 /* D / 16 for D <= 256 */

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

/* r[j] word i -> r[i] word j: a 16 x 16 transpose of 32-bit words (unpack 32, unpack 64, then
 * two rounds of 128-bit lane shuffles). */
INLINE void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[i + e] lane k: word 4k + e of rows i .. i+3 */
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int h = 0; h < 16; h += 8)
        for (int e = 0; e < 4; e++) {
            t[h + e] = _mm512_shuffle_i32x4(r[h + e], r[h + 4 + e], 0x88);     /* words e, e + 8 */
            t[h + 4 + e] = _mm512_shuffle_i32x4(r[h + e], r[h + 4 + e], 0xdd); /* words e + 4, e + 12 */
        }
    for (int e = 0; e < 8; e++) {
        r[e] = _mm512_shuffle_i32x4(t[e], t[8 + e], 0x88);
        r[8 + e] = _mm512_shuffle_i32x4(t[e], t[8 + e], 0xdd);
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
        const int full = first + kt * 16 + 15 <= last; /* 16 real keys: transposed in registers */
        const uint32_t *krows[16];
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
            if (full)
                krows[j] = krow;
            else
                for (int pi = 0; pi < DP; pi++)
                    tile[(size_t)pi * 16 + j] = krow[pi];
            for (int c = 0; c < D; c += 16) {
                const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(vrow + c)));
                __m512i *dst = (__m512i *)(vd + c);
                _mm512_store_si512(dst, j % 2 ? _mm512_or_si512(_mm512_load_si512(dst), _mm512_slli_epi32(w, 16))
                                              : w);
            }
        }
        if (full)
            for (int c = 0; c < DP; c += 16) { /* D % 32 == 0: whole 16-word columns */
                __m512i r[16];
                for (int j = 0; j < 16; j++)
                    r[j] = _mm512_loadu_si512(krows[j] + c);
                transpose16(r);
                for (int pi = 0; pi < 16; pi++)
                    _mm512_store_si512(tile + (size_t)(c + pi) * 16, r[pi]);
            }
    }
    /* Rows are (position, head) pairs, the G heads of a position side by side, 4 at a time: a
     * decode step (one position) sweeps the keys once for up to 4 heads. Grouping never changes
     * a row's bits: a tile outside a row's keys is an exact no-op for it (scores -inf, rescale
     * exp(0) = 1, probabilities 0). */
    const int n_rows = (tk.i1 - tk.i0) * G;
    for (int i = 0; i < n_rows; i += 4) {
        const int nr = n_rows - i < 4 ? n_rows - i : 4;
        const uint32_t *qrow[4];
        float *orow[4];
        int qpos[4], lo[4];
        for (int r = 0; r < 4; r++) {
            const int idx = i + (r < nr ? r : nr - 1), ii = tk.i0 + idx / G, g = idx % G;
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
#endif

/* ---- vec8 path -----------------------------------------------------------------------------
 * A task is (sequence s, KV head h, a chunk of V8_QROWS query positions), all G query heads of
 * h. Its keys are swept in blocks of V8_KEYS: each block is copied (bf16 widened) into K tiles
 * of 8 keys stored dim-major (kt[(tile * D + d) * 8 + j]: the scores of 8 keys for one query row
 * are D broadcast-FMAs, no horizontal sums) and V rows (v[j * D + d]), ~32 KB at D = 64 that stay
 * in L1 while every query row of the task that sees the block goes over it, V8_R rows at a time.
 * Key block outermost means each K/V row is copied once per task and the rows' running state
 * (unnormalised outputs, max, sum: G x V8_QROWS x D floats) lives in L2 between blocks.
 */
#include "vec8.h"
#include "vec8_attention.h"

#define V8_QROWS 64 /* query positions per task: enough rows to amortise the K/V copy */
#define V8_KEYS 64  /* keys per block */
#define V8_R (V8_NARROW ? 2 : 4) /* query rows per micro-kernel: 4 rows x 2 key tiles = 8 accumulators */

typedef struct {
    float *kt, *v; /* the current key block, layouts above */
    float *q;      /* the task's queries times scale: q[(i * G + g) * D + d] */
    float *o;      /* unnormalised outputs, same layout */
    float *m, *l;  /* running max and sum per row [i * G + g] */
} v8_scratch;

INLINE float ld1(const void *p, size_t i, int bf16) {
    if (bf16) {
        const uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &u, sizeof f);
        return f;
    }
    return ((const float *)p)[i];
}

/* Keys k0 .. k0+nk-1 of (sequence table, head h) into the block buffers; the last tile's unused
 * columns and rows are zeros (never a stale NaN: p = 0 times NaN would still be NaN). */
INLINE void v8_copy_block(const void *kc, const void *vc, const int32_t *table, int h, int Hkv, int D,
                          int BS, int k0, int nk, int bf16, float *kt, float *v) {
    for (int j = 0; j < nk; j++) {
        const int t = k0 + j;
        const size_t row = (((size_t)table[t / BS] * BS + t % BS) * Hkv + h) * D;
        float *kd = kt + (size_t)(j / 8) * D * 8 + j % 8;
        for (int d = 0; d < D; d++)
            kd[(size_t)d * 8] = ld1(kc, row + d, bf16);
        for (int d = 0; d < D; d += 8)
            v8_store(v + (size_t)j * D + d, v8_load_kv(vc, row + d, bf16));
    }
    for (int j = nk; j % 8; j++) {
        float *kd = kt + (size_t)(j / 8) * D * 8 + j % 8;
        for (int d = 0; d < D; d++)
            kd[(size_t)d * 8] = 0.f;
        memset(v + (size_t)j * D, 0, sizeof(float) * D);
    }
}

/* S[r][8 (t - t0) + j] = q_r . key (8 t + j) for tiles [t0, t1), two tiles at a time: per dim
 * 2 tile loads and V8_R broadcasts feed 2 V8_R FMAs. */
INLINE void v8_scores(const float *const qr[V8_R], const float *kt, int t0, int t1, int D,
                      float S[V8_R][V8_KEYS]) {
    int t = t0;
    for (; t + 2 <= t1; t += 2) {
        const float *k0 = kt + (size_t)t * D * 8, *k1 = k0 + (size_t)D * 8;
        v8acc a[V8_R][2];
        for (int r = 0; r < V8_R; r++)
            a[r][0] = a[r][1] = v8acc_of(v8_zero());
        for (int d = 0; d < D; d++) {
            v8f x = v8_load(k0 + 8 * d), y = v8_load(k1 + 8 * d);
            V8_IN_REG(x);
            V8_IN_REG(y);
            for (int r = 0; r < V8_R; r++) {
                const v8f b = v8_set1(qr[r][d]);
                a[r][0] = v8acc_fma(a[r][0], b, x);
                a[r][1] = v8acc_fma(a[r][1], b, y);
            }
        }
        for (int r = 0; r < V8_R; r++) {
            v8_store(&S[r][8 * (t - t0)], v8acc_get(a[r][0]));
            v8_store(&S[r][8 * (t - t0) + 8], v8acc_get(a[r][1]));
        }
    }
    if (t < t1) {
        const float *k0 = kt + (size_t)t * D * 8;
        v8acc a[V8_R];
        for (int r = 0; r < V8_R; r++)
            a[r] = v8acc_of(v8_zero());
        for (int d = 0; d < D; d++) {
            v8f x = v8_load(k0 + 8 * d);
            V8_IN_REG(x);
            for (int r = 0; r < V8_R; r++)
                a[r] = v8acc_fma(a[r], v8_set1(qr[r][d]), x);
        }
        for (int r = 0; r < V8_R; r++)
            v8_store(&S[r][8 * (t - t0)], v8acc_get(a[r]));
    }
}

/* o_r = o_r * corr_r + sum over keys [j0, j1) of P[r][j - jb] v_j, on dims [c, c + 8 NC). */
INLINE void v8_pv(float *const orow[V8_R], const float corr[V8_R], float P[V8_R][V8_KEYS], const float *v,
                  int jb, int j0, int j1, int c, int D, int nr, int NC) {
    v8acc a[V8_R][2];
    for (int r = 0; r < V8_R; r++)
        for (int k = 0; k < NC; k++)
            a[r][k] = v8acc_of(v8_load(orow[r] + c + 8 * k) * corr[r]);
    for (int j = j0; j < j1; j++) {
        v8f x[2];
        for (int k = 0; k < NC; k++) {
            x[k] = v8_load(v + (size_t)j * D + c + 8 * k);
            V8_IN_REG(x[k]);
        }
        for (int r = 0; r < V8_R; r++) {
            const v8f b = v8_set1(P[r][j - jb]);
            for (int k = 0; k < NC; k++)
                a[r][k] = v8acc_fma(a[r][k], b, x[k]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int k = 0; k < NC; k++)
            v8_store(orow[r] + c + 8 * k, v8acc_get(a[r][k]));
}

/* Scratch rows row0 .. row0+nr-1 (nr <= V8_R; any heads and positions) against the
 * current key block of nk keys. pos[r] and lo[r] are row r's own position and first visible key,
 * relative to the block's first key. Rows past nr repeat row nr-1: computed, never stored. */
INLINE void v8_rows(v8_scratch *sc, int row0, int nr, const int pos[V8_R], const int lo[V8_R], int nk,
                    int D) {
    float S[V8_R][V8_KEYS] __attribute__((aligned(32)));
    int jlo = nk, jhi = -1, hi[V8_R];
    for (int r = 0; r < V8_R; r++) {
        hi[r] = pos[r] < nk - 1 ? pos[r] : nk - 1;
        const int l0 = lo[r] > 0 ? lo[r] : 0;
        jlo = l0 < jlo ? l0 : jlo;
        jhi = hi[r] > jhi ? hi[r] : jhi;
    }
    if (jlo > jhi)
        return; /* no row sees any key of this block */
    const int t0 = jlo / 8, t1 = jhi / 8 + 1, jb = 8 * t0;
    int full = 1; /* every row sees every key of tiles [t0, t1): no masks */
    for (int r = 0; r < V8_R; r++)
        full &= lo[r] <= jb && hi[r] >= 8 * t1 - 1;
    const float *qr[V8_R];
    float *orow[V8_R];
    for (int r = 0; r < V8_R; r++) {
        const int ri = row0 + (r < nr ? r : nr - 1);
        qr[r] = sc->q + (size_t)ri * D;
        orow[r] = sc->o + (size_t)ri * D;
    }
    v8_scores(qr, sc->kt, t0, t1, D, S);
    /* online softmax: the block's max per row, then probabilities in place of the scores */
    v8f bmax = v8_set1(-INFINITY), mold = v8_zero();
    const v8i lane = {0, 1, 2, 3, 4, 5, 6, 7};
    for (int r = 0; r < V8_R; r++) {
        v8f mx = v8_set1(-INFINITY);
        for (int t = 0; t < t1 - t0; t++) {
            v8f x = v8_load(&S[r][8 * t]);
            if (!full) {
                const v8i j = lane + (jb + 8 * t);
                x = v8_select((j >= lo[r]) & (j <= hi[r]), x, v8_set1(-INFINITY));
                v8_store(&S[r][8 * t], x);
            }
            mx = v8_max(mx, x);
        }
        bmax[r] = v8_hmax(mx);
        mold[r] = sc->m[row0 + (r < nr ? r : nr - 1)];
    }
    /* m starts at -1e30, not -inf: a row's first rescale is exp(-huge) on zeros, never NaN */
    const v8f mnew = v8_max(mold, bmax);
    const v8f corr8 = v8_exp(mold - mnew);
    float corr[V8_R];
    for (int r = 0; r < V8_R; r++) {
        v8f sum = v8_zero();
        for (int t = 0; t < t1 - t0; t++) {
            v8f p = v8_exp(v8_load(&S[r][8 * t]) - mnew[r]);
            if (!full) /* masked scores are -inf: exp clamps them to 1e-38, make them 0 */
                p = v8_select(v8_load(&S[r][8 * t]) == v8_set1(-INFINITY), v8_zero(), p);
            v8_store(&S[r][8 * t], p);
            sum += p;
        }
        corr[r] = corr8[r];
        if (r < nr) {
            sc->l[row0 + r] = sc->l[row0 + r] * corr[r] + v8_hsum(sum);
            sc->m[row0 + r] = mnew[r];
        }
    }
    int c = 0;
    for (; c + 16 <= D; c += 16)
        v8_pv(orow, corr, S, sc->v, jb, jlo, jhi + 1, c, D, nr, 2);
    if (c < D)
        v8_pv(orow, corr, S, sc->v, jb, jlo, jhi + 1, c, D, nr, 1);
}

INLINE void v8_prefill_task(const void *q, const void *kc, const void *vc, const int32_t *tables,
                            const int32_t *lens, const int32_t *qstart, float *out, prefill_task tk, int Hq,
                            int Hkv, int D, int BS, int MB, float scale, int window, int bf16, v8_scratch *sc) {
    const int G = Hq / Hkv, n = tk.i1 - tk.i0;
    const int L = lens[tk.s];
    const int base = L - (qstart[tk.s + 1] - qstart[tk.s]); /* position of the chunk's first query */
    const int32_t *table = tables + (size_t)tk.s * MB;
    /* scratch row i * G + g: the G heads of a position side by side (see the AVX-512 kernel) */
    for (int g = 0; g < G; g++)
        for (int i = 0; i < n; i++) {
            const size_t src = ((size_t)(qstart[tk.s] + tk.i0 + i) * Hq + (size_t)tk.h * G + g) * D;
            const size_t row = (size_t)i * G + g;
            for (int d = 0; d < D; d += 8) {
                v8_store(sc->q + row * D + d, v8_load_kv(q, src + d, bf16) * scale);
                v8_store(sc->o + row * D + d, v8_zero());
            }
            sc->m[row] = -1e30f;
            sc->l[row] = 0.f;
        }
    const int p0 = base + tk.i0, last = base + tk.i1 - 1;
    /* key blocks start at multiples of V8_KEYS whatever the chunk (a window's first keys are
     * masked): a row's online-softmax steps, and so its bits, do not depend on the chunking */
    int first = window > 0 && p0 - window + 1 > 0 ? p0 - window + 1 : 0;
    first -= first % V8_KEYS;
    for (int k0 = first; k0 <= last; k0 += V8_KEYS) {
        const int nk = last + 1 - k0 < V8_KEYS ? last + 1 - k0 : V8_KEYS;
        v8_copy_block(kc, vc, table, tk.h, Hkv, D, BS, k0, nk, bf16, sc->kt, sc->v);
        for (int i = 0; i < n * G; i += V8_R) {
            const int nr = n * G - i < V8_R ? n * G - i : V8_R;
            int pos[V8_R], lo[V8_R];
            for (int r = 0; r < V8_R; r++) {
                pos[r] = p0 + (i + (r < nr ? r : nr - 1)) / G - k0;
                lo[r] = window > 0 ? pos[r] - window + 1 : -k0;
            }
            v8_rows(sc, i, nr, pos, lo, nk, D);
        }
    }
    for (int g = 0; g < G; g++)
        for (int i = 0; i < n; i++) {
            const size_t row = (size_t)i * G + g;
            const float lsum = sc->l[row];
            const v8f inv = v8_set1(lsum > 0.f ? 1.f / lsum : 0.f);
            float *dst = out + ((size_t)(qstart[tk.s] + tk.i0 + i) * Hq + (size_t)tk.h * G + g) * D;
            for (int d = 0; d < D; d += 8)
                v8_store(dst + d, v8_load(sc->o + row * D + d) * inv);
        }
}

typedef struct {
    long cost; /* query rows x keys they see, about */
    prefill_task t;
} v8_costed_task;

static int v8_by_cost(const void *a, const void *b) {
    const long x = ((const v8_costed_task *)a)->cost, y = ((const v8_costed_task *)b)->cost;
    return (x < y) - (x > y);
}

static int v8_prefill(const void *q, const void *kc, const void *vc, const int32_t *tables, const int32_t *lens,
                      const int32_t *qstart, float *out, int S, int Hq, int Hkv, int D, int BS, int MB,
                      float scale, int window, int nthreads, int bf16) {
    if (D % 8 || D > 256 || D <= 0 || Hkv <= 0 || Hq % Hkv)
        return -1;
    const int G = Hq / Hkv;
    int n = 0;
    for (int s = 0; s < S; s++)
        n += Hkv * ((qstart[s + 1] - qstart[s] + V8_QROWS - 1) / V8_QROWS);
    v8_costed_task *tasks = malloc(sizeof(v8_costed_task) * (size_t)(n > 0 ? n : 1));
    if (!tasks)
        return -1;
    n = 0;
    for (int s = 0; s < S; s++) {
        const int q_len = qstart[s + 1] - qstart[s];
        for (int i0 = 0; i0 < q_len; i0 += V8_QROWS) {
            const int i1 = i0 + V8_QROWS < q_len ? i0 + V8_QROWS : q_len;
            const int last = lens[s] - q_len + i1 - 1, first = window > 0 ? last - (i1 - i0) - window + 2 : 0;
            const long keys = last + 1 - (first > 0 ? first : 0);
            for (int h = 0; h < Hkv; h++)
                tasks[n++] = (v8_costed_task){keys * (i1 - i0), {s, h, i0, i1}};
        }
    }
    /* the costliest tasks first: the chunks late in a prompt see the most keys, and left at the
     * end of the loop they are the tail one thread finishes alone */
    qsort(tasks, (size_t)n, sizeof *tasks, v8_by_cost);
    const size_t rows = (size_t)G * V8_QROWS;
    int failed = 0;
    _Pragma("omp parallel num_threads(nthreads)")
    {
        float *buf = aligned_alloc(64, (sizeof(float) * ((2 * V8_KEYS + 2 * rows) * D + 2 * rows) + 63) / 64 * 64);
        v8_scratch sc = {0};
        if (buf)
            sc = (v8_scratch){buf, buf + V8_KEYS * D, buf + 2 * V8_KEYS * D, buf + (2 * V8_KEYS + rows) * D,
                              buf + (2 * V8_KEYS + 2 * rows) * D, buf + (2 * V8_KEYS + 2 * rows) * D + rows};
        else {
            _Pragma("omp atomic write")
            failed = 1;
        }
        /* D is a literal in the calls below (the region is outlined before anything is inlined),
         * so the common head dims get fully unrolled inner loops */
        _Pragma("omp for schedule(dynamic, 1)")
        for (int i = 0; i < n; i++) {
            if (!buf)
                continue;
            if (D == 64)
                v8_prefill_task(q, kc, vc, tables, lens, qstart, out, tasks[i].t, Hq, Hkv, 64, BS, MB, scale,
                                window, bf16, &sc);
            else if (D == 128)
                v8_prefill_task(q, kc, vc, tables, lens, qstart, out, tasks[i].t, Hq, Hkv, 128, BS, MB, scale,
                                window, bf16, &sc);
            else
                v8_prefill_task(q, kc, vc, tables, lens, qstart, out, tasks[i].t, Hq, Hkv, D, BS, MB, scale,
                                window, bf16, &sc);
        }
        free(buf);
    }
    free(tasks);
    return failed ? -1 : 0;
}

int paged_prefill_bf16(const uint16_t *q, const uint16_t *kc, const uint16_t *vc, const int32_t *tables,
                       const int32_t *lens, const int32_t *qstart, float *out, int S, int Hq, int Hkv,
                       int D, int BS, int MB, float scale, int window, int nthreads) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
    if (D % 32 || D > 256 || Hkv <= 0 || Hq % Hkv) /* vdpbf16ps wants 32-dim chunks */
        return v8_prefill(q, kc, vc, tables, lens, qstart, out, S, Hq, Hkv, D, BS, MB, scale, window, nthreads, 1);
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
    return v8_prefill(q, kc, vc, tables, lens, qstart, out, S, Hq, Hkv, D, BS, MB, scale, window, nthreads, 1);
#endif
}

int paged_prefill_f32(const float *q, const float *kc, const float *vc, const int32_t *tables, const int32_t *lens,
                      const int32_t *qstart, float *out, int S, int Hq, int Hkv, int D, int BS, int MB,
                      float scale, int window, int nthreads) {
    return v8_prefill(q, kc, vc, tables, lens, qstart, out, S, Hq, Hkv, D, BS, MB, scale, window, nthreads, 0);
}
