/* Weight-only quantised linear layers: out[M, N] = x[M, K] . dequant(W)[N, K]^T (+ bias), with
 * fp32 (dt = 0) or bf16 (dt = 1) activations, bias and output; fp32 math inside, the output
 * rounded once. Formats (kernels/quant_linear.py documents them):
 *   int8: q int8 [N, K], scales fp32 [N] (per channel):  w[n, k] = q[n, k] * scales[n]
 *         or scales fp32 [N, K/g] (per group):           w[n, k] = q[n, k] * scales[n, k/g]
 *   int4: q uint8 [N, K/2], scales, mins fp32 [N, K/g]:  w[n, k] = q[n, k] * scales[n, k/g] + mins[n, k/g]
 *         each run of 32 k packed in 16 bytes: byte i holds q[i] (low nibble), q[i + 16] (high).
 *
 * Three kernels, picked by the number of rows M (thresholds measured, see QL_GEMM_MIN_M_INT8):
 * - few rows (decode): dot tiles. A tile of R rows x 4 output channels reads the quantised rows
 *   as they are, widens a vector of weights at a time in registers (int8 -> int32 -> fp32, or
 *   bytes -> two vectors of nibbles) and FMAs it with every row of the tile, so one conversion
 *   serves R rows; the partial sums are reduced across lanes once at the end. Per-channel int8
 *   scales the finished sum; group-wise int8 multiplies each widened weight vector by its group's
 *   scale before the FMAs (one multiply per R rows; a partial sum per group, as int4 does, needs
 *   twice the accumulators and measured slower); int4 scales each group's partial sum and adds
 *   mins . (sums of x over each group, precomputed): sum_k (q s + m) x = s sum_k q x + m sum_k x
 *   over a group. Weights are prefetched a few tiles ahead: a tile reads K-byte rows from 4
 *   places at once, too short a stream for the hardware prefetchers.
 * - int4, a few rows: 4 channels at a time are dequantised (q s + m) to fp32 rows in L1 and the
 *   rows of x run 3 x 4 fp32 dot tiles over them (in registers, int4 costs more per weight than
 *   int8, so converting once pays from 5 rows).
 * - many rows (prefill): a GEMM. Each thread dequantises a panel of 2 vectors of output channels
 *   to fp32, transposed to [K][channels] (in-register transposes), and runs a 6-row broadcast
 *   micro-kernel (12 accumulators) over every row of x: torch's MKL fp32 speed from M ~ 100,
 *   the dequantisation paid once per panel (per-channel int8 panels hold q, the scales applied
 *   to the sums; group-wise int8 and int4 panels hold the dequantised weights).
 * Output channels (tiles or panels) are split over OpenMP threads when there is enough work.
 *
 * Vectors are GCC generic vectors of the machine's width: 8 lanes (vec8.h's v8f: one AVX2
 * register) on AVX2 builds, AVX-512 ones included, 4 lanes elsewhere (SSE2, NEON). vec8.h's
 * 8-lane type on a 128-bit ISA is two registers, and GCC 12 then keeps these kernels' loop-
 * carried accumulators in memory and widens bytes one scalar load at a time: measured 7-10x
 * slower than AVX2 on the SSE2 build, against ~2-3x with 4-lane vectors.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INLINE static inline __attribute__((always_inline))
#include "bf16.h"

#pragma GCC diagnostic ignored "-Wpsabi" /* 32-byte vectors without AVX: internal functions only */

#if defined(__AVX2__)
#define VL 8
#else
#define VL 4
#endif
typedef float vf __attribute__((vector_size(4 * VL)));
typedef int32_t vi __attribute__((vector_size(4 * VL)));
typedef uint32_t vu __attribute__((vector_size(4 * VL)));

/* Work (M * N * K multiply-adds) below which one thread does it all: a parallel region costs a
 * few microseconds. */
#ifndef QL_PAR_MIN_WORK
#define QL_PAR_MIN_WORK (1 << 17)
#endif
/* How many tiles (or panels) ahead the weights are prefetched: 2 and 4 measure the same, none is
 * 2x slower on lm_head at M = 1 (4.8 vs 2.4 ms, int8, one thread). */
#ifndef QL_PF
#define QL_PF 4
#endif
/* Which kernel from how many rows. Minimum ms of 9-11 interleaved runs, one thread, 2-core Zen 3
 * (AVX2), SmolLM2-135M shapes (qkv / o / gate_up / down / lm_head), int4 with g = 32:
 *   int8 M = 10   dot tiles .199 .127 .621 .289 10.1   GEMM .214 .132 .673 .321 11.2
 *   int8 M = 12   dot tiles .225 .139 .687 .474 11.1   GEMM .212 .132 .654 .435 11.0
 *   int4 M = 4    dot tiles .124 .082 .386 .168  6.0   fp32 rows .134 .084 .365 .196  5.8
 *   int4 M = 6    dot tiles .181 .113 .552 .251  8.9   fp32 rows .166 .103 .446 .240  7.2
 *   int4 M = 10   fp32 rows .258 .161 .785 .361 11.7   GEMM .264 .164 .806 .403 13.5
 *   int4 M = 14   fp32 rows .335 .207 1.04 .647 18.5   GEMM .304 .191 .936 .721 17.6
 * (int8 never gains from the fp32-rows kernel: its dot tiles convert a weight vector with one
 * instruction, int4's with two.) Group-wise int8 multiplies each weight vector by its scale in the
 * dot tiles, which the GEMM does once per panel: it moves to the GEMM earlier. Medians of 9-15
 * interleaved runs, 30 layers + lm_head together, g = 32 / g = 64 (ms; a busy machine):
 *   M = 6,  1 thread    dot tiles 15.1 / 14.1   GEMM 17.0 / 16.5   (10 layers)
 *   M = 8,  2 threads   dot tiles 34.4 / 32.1   GEMM 33.6 / 33.0
 *   M = 9,  2 threads   dot tiles 24.9 / 24.8   GEMM 27.0 / 25.9
 *   M = 10, 2 threads   dot tiles 33.2 / 31.0   GEMM 29.4 / 28.6
 *   M = 11, 2 threads   dot tiles 31.3 / 31.8   GEMM 28.0 / 27.9
 * (the fp32-rows kernel, tried for it too, lost to one or the other at every M from 2 to 11). */
#ifndef QL_GEMM_MIN_M_INT8
#define QL_GEMM_MIN_M_INT8 12
#endif
#ifndef QL_GEMM_MIN_M_INT8G
#define QL_GEMM_MIN_M_INT8G 10
#endif
#ifndef QL_ROWS_MIN_M_INT4
#define QL_ROWS_MIN_M_INT4 5
#endif
#ifndef QL_GEMM_MIN_M_INT4
#define QL_GEMM_MIN_M_INT4 12
#endif

/* ---- vectors ------------------------------------------------------------------------------ */

INLINE vf vload(const float *p) {
    vf v;
    memcpy(&v, p, sizeof v); /* unaligned; one vector load */
    return v;
}

INLINE void vstore(float *p, vf v) { memcpy(p, &v, sizeof v); }
INLINE vf vzero(void) { return (vf){0}; }
INLINE vf vset1(float x) { return vzero() + x; }

INLINE float vhsum(vf v) {
#if VL == 8
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
#else
    return (v[0] + v[2]) + (v[1] + v[3]);
#endif
}

/* VL weight bytes, one per 32-bit lane: sign-extended (s8) or zero-extended (u8). */
#if VL == 8
/* Written lane by lane, which GCC 12 turns into one vpmovsxbd / vpmovzxbd; an 8-byte vector type
 * put through __builtin_convertvector becomes 8 scalar extracts and inserts. */
INLINE vi widen_s8(const int8_t *p) { return (vi){p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]}; }
INLINE vi widen_u8(const uint8_t *p) { return (vi){p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]}; }
#else
typedef int8_t vb __attribute__((vector_size(16)));
typedef int16_t vh __attribute__((vector_size(16)));

/* Each of 4 bytes repeated across its lane (two interleaves: punpcklbw + punpcklwd on SSE2, two
 * zip1 on NEON); a shift then extends it. Loading the lanes one by one is 4 scalar loads there. */
INLINE vi spread4(const void *p) {
    int32_t u;
    memcpy(&u, p, sizeof u);
    const vb b = (vb)(vi){u, 0, 0, 0};
    const vb b2 = __builtin_shufflevector(b, b, 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    return (vi)__builtin_shufflevector((vh)b2, (vh)b2, 0, 8, 1, 9, 2, 10, 3, 11);
}

INLINE vi widen_s8(const int8_t *p) { return spread4(p) >> 24; }
INLINE vi widen_u8(const uint8_t *p) { return (vi)((vu)spread4(p) >> 24); }
#endif

INLINE vf ld_i8(const int8_t *p) { return __builtin_convertvector(widen_s8(p), vf); }
INLINE vf lo_nib(vi b) { return __builtin_convertvector(b & 15, vf); }
INLINE vf hi_nib(vi b) { return __builtin_convertvector(b >> 4, vf); }

/* The nibbles for k + off .. k + off + VL - 1 of a 32-k run at row + k / 2 (off a multiple of VL). */
INLINE vf nibbles(const uint8_t *run, int off) {
    const vi b = widen_u8(run + off % 16);
    return off < 16 ? lo_nib(b) : hi_nib(b);
}

INLINE float ldv(const void *p, int64_t i, int dt) {
    return dt ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE void stv(void *p, int64_t i, float f, int dt) {
    if (dt)
        ((uint16_t *)p)[i] = to_bf16_bits(f);
    else
        ((float *)p)[i] = f;
}

/* x as fp32 rows: x itself, or a converted copy in *buf (freed by the caller). NULL: no memory. */
static const float *fp32_rows(const void *x, int64_t n, int dt, float **buf) {
    *buf = NULL;
    if (!dt)
        return (const float *)x;
    float *f = malloc(sizeof(float) * (size_t)(n + 1));
    if (!f)
        return NULL;
    const uint16_t *h = (const uint16_t *)x;
    for (int64_t i = 0; i < n; i++) /* vectorised by GCC */
        f[i] = bf16_to_f32(h[i]);
    *buf = f;
    return f;
}

/* ---- few rows: dot tiles, weights widened in registers ---------------------------------------- */

#define RMAX 3
#define C 4 /* output channels per tile */
#if defined(__AVX2__) || defined(__aarch64__)
#define I8_R 3 /* 3 x 4: 12 accumulators + 3 vectors of x + 1 of weights; 16 registers */
#else
#define I8_R 2 /* SSE2: the widening needs 2 more registers */
#endif
#define I4_R 2

/* Rows m0 .. m0 + R - 1 (x points at row m0) x channels n0 .. n0 + nc - 1 of the per-channel int8
 * layer, channel n's scale at scales[n * lds] (a tail tile, nc < C, recomputes its last channel in
 * the missing places and stores nc). */
INLINE void i8_tile(const float *x, const int8_t *q, int64_t ldq, const float *scales, int64_t lds,
                    const void *bias, void *out, int64_t N, int64_t K, int64_t m0, int64_t n0, int nc, int R,
                    int dt) {
    const int8_t *w[C];
    for (int c = 0; c < C; c++)
        w[c] = q + (n0 + (c < nc ? c : nc - 1)) * ldq;
    /* The tile QL_PF tiles ahead (the rows that follow, when rows are contiguous), a line every
     * step or two: see the top of the file. */
    const char *pf = (const char *)(q + (n0 + QL_PF * C) * ldq);
    vf acc[RMAX][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = vzero();
    int64_t k = 0;
    for (; k + VL <= K; k += VL) {
        __builtin_prefetch(pf + C * k);
        vf xv[RMAX];
        for (int r = 0; r < R; r++)
            xv[r] = vload(x + r * K + k);
        for (int c = 0; c < C; c++) {
            const vf wv = ld_i8(w[c] + k);
            for (int r = 0; r < R; r++)
                acc[r][c] += xv[r] * wv;
        }
    }
    float res[RMAX][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            res[r][c] = vhsum(acc[r][c]);
    for (; k < K; k++)
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                res[r][c] += x[r * K + k] * (float)w[c][k];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nc && c < C; c++) {
            const int64_t n = n0 + c;
            stv(out, (m0 + r) * N + n, res[r][c] * scales[n * lds] + (bias ? ldv(bias, n, dt) : 0.f), dt);
        }
}

/* The group-wise int8 tile: scales [N, K / g] (rows lds apart), g a multiple of VL dividing K. */
INLINE void i8g_tile(const float *x, const int8_t *q, int64_t ldq, const float *scales, int64_t lds,
                     const void *bias, void *out, int64_t N, int64_t K, int64_t g, int64_t m0, int64_t n0, int nc,
                     int R, int dt) {
    const int64_t G = K / g;
    const int8_t *w[C];
    const float *sc[C];
    for (int c = 0; c < C; c++) {
        const int64_t n = n0 + (c < nc ? c : nc - 1);
        w[c] = q + n * ldq;
        sc[c] = scales + n * lds;
    }
    const int64_t ahead = n0 + QL_PF * C; /* see i8_tile */
    const char *pf = (const char *)(q + ahead * ldq), *pfs = (const char *)(scales + ahead * lds);
    vf acc[RMAX][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = vzero();
    for (int64_t j = 0; j < G; j++) {
        __builtin_prefetch(pfs + j * C * 4);
        vf s[C];
        for (int c = 0; c < C; c++)
            s[c] = vset1(sc[c][j]);
        for (int64_t k = j * g; k < (j + 1) * g; k += VL) {
            __builtin_prefetch(pf + C * k);
            vf xv[RMAX];
            for (int r = 0; r < R; r++)
                xv[r] = vload(x + r * K + k);
            for (int c = 0; c < C; c++) {
                const vf wv = ld_i8(w[c] + k) * s[c];
                for (int r = 0; r < R; r++)
                    acc[r][c] += xv[r] * wv;
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nc && c < C; c++) {
            const int64_t n = n0 + c;
            stv(out, (m0 + r) * N + n, vhsum(acc[r][c]) + (bias ? ldv(bias, n, dt) : 0.f), dt);
        }
}

/* The int4 tile: x rows as in i8_tile, xs their sums over each group ([rows, K / g]). */
INLINE void i4_tile(const float *x, const float *xs, const uint8_t *q, int64_t ldq, const float *scales,
                    const float *mins, int64_t lds, const void *bias, void *out, int64_t N, int64_t K, int64_t g,
                    int64_t m0, int64_t n0, int nc, int R, int dt) {
    const int64_t G = K / g;
    const uint8_t *w[C];
    const float *sc[C], *mn[C];
    for (int c = 0; c < C; c++) {
        const int64_t n = n0 + (c < nc ? c : nc - 1);
        w[c] = q + n * ldq;
        sc[c] = scales + n * lds;
        mn[c] = mins + n * lds;
    }
    const int64_t ahead = n0 + QL_PF * C; /* see i8_tile */
    const char *pf = (const char *)(q + ahead * ldq);
    const char *pfs = (const char *)(scales + ahead * lds), *pfm = (const char *)(mins + ahead * lds);
    vf acc[RMAX][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = vzero();
    for (int64_t j = 0; j < G; j++) {
        __builtin_prefetch(pfs + j * C * 4);
        __builtin_prefetch(pfm + j * C * 4);
        vf part[RMAX][C];
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                part[r][c] = vzero();
        for (int64_t k = j * g; k < (j + 1) * g; k += 32) {
            __builtin_prefetch(pf + C * k / 2); /* C * 16 bytes a step */
            for (int c = 0; c < C; c++) {
                const uint8_t *run = w[c] + k / 2;
                for (int off = 0; off < 32; off += VL) {
                    const vf wv = nibbles(run, off);
                    for (int r = 0; r < R; r++)
                        part[r][c] += vload(x + r * K + k + off) * wv;
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int c = 0; c < C; c++)
                acc[r][c] += part[r][c] * sc[c][j];
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nc && c < C; c++) {
            /* the mins term: sum over groups of mins * (sum of x over the group) */
            vf m = vzero();
            int64_t j = 0;
            for (; j + VL <= G; j += VL)
                m += vload(mn[c] + j) * vload(xs + r * G + j);
            float t = vhsum(m);
            for (; j < G; j++)
                t += mn[c][j] * xs[r * G + j];
            const int64_t n = n0 + c;
            stv(out, (m0 + r) * N + n, vhsum(acc[r][c]) + t + (bias ? ldv(bias, n, dt) : 0.f), dt);
        }
}

/* One instantiation per row count, picked by the rows left. */
#define I8_TILE(R)                                                                                          \
    static void i8_tile_##R(const float *x, const int8_t *q, int64_t ldq, const float *s, int64_t lds,     \
                            const void *b, void *o, int64_t N, int64_t K, int64_t m0, int64_t n0, int nc,  \
                            int dt) {                                                                       \
        if (dt)                                                                                             \
            i8_tile(x, q, ldq, s, lds, b, o, N, K, m0, n0, nc, R, 1);                                       \
        else                                                                                                \
            i8_tile(x, q, ldq, s, lds, b, o, N, K, m0, n0, nc, R, 0);                                       \
    }
/* Group-wise int8, per group size as int4 below. */
#define I8G_BODY(R, G, DT) i8g_tile(x, q, ldq, s, lds, b, o, N, K, G, m0, n0, nc, R, DT)
#define I8G_TILE(R)                                                                                         \
    static void i8g_tile_##R(const float *x, const int8_t *q, int64_t ldq, const float *s, int64_t lds,    \
                             const void *b, void *o, int64_t N, int64_t K, int64_t g, int64_t m0,          \
                             int64_t n0, int nc, int dt) {                                                  \
        if (g == 32)                                                                                        \
            dt ? I8G_BODY(R, 32, 1) : I8G_BODY(R, 32, 0);                                                   \
        else if (g == 64)                                                                                   \
            dt ? I8G_BODY(R, 64, 1) : I8G_BODY(R, 64, 0);                                                   \
        else if (g == 128)                                                                                  \
            dt ? I8G_BODY(R, 128, 1) : I8G_BODY(R, 128, 0);                                                 \
        else                                                                                                \
            dt ? I8G_BODY(R, g, 1) : I8G_BODY(R, g, 0);                                                     \
    }
/* int4 also per group size, a constant in the body: the runs of a group unroll and their partial
 * sums stay in registers (with g a variable GCC keeps them on the stack: 5-10% slower at M = 1,
 * 20% at M = 2). */
#define I4_BODY(R, G, DT) i4_tile(x, xs, q, ldq, s, mn, lds, b, o, N, K, G, m0, n0, nc, R, DT)
#define I4_TILE(R)                                                                                          \
    static void i4_tile_##R(const float *x, const float *xs, const uint8_t *q, int64_t ldq, const float *s, \
                            const float *mn, int64_t lds, const void *b, void *o, int64_t N, int64_t K,    \
                            int64_t g, int64_t m0, int64_t n0, int nc, int dt) {                           \
        if (g == 32)                                                                                        \
            dt ? I4_BODY(R, 32, 1) : I4_BODY(R, 32, 0);                                                     \
        else if (g == 64)                                                                                   \
            dt ? I4_BODY(R, 64, 1) : I4_BODY(R, 64, 0);                                                     \
        else if (g == 128)                                                                                  \
            dt ? I4_BODY(R, 128, 1) : I4_BODY(R, 128, 0);                                                   \
        else                                                                                                \
            dt ? I4_BODY(R, g, 1) : I4_BODY(R, g, 0);                                                       \
    }
I8_TILE(1)
I8_TILE(2)
I8G_TILE(1)
I8G_TILE(2)
#if I8_R == 3
I8_TILE(3)
I8G_TILE(3)
#endif
I4_TILE(1)
I4_TILE(2)

/* All M rows of x against channels n0 .. n0 + nc - 1; per channel when g == K. */
static void i8_rows(const float *x, const int8_t *q, int64_t ldq, const float *s, int64_t lds, const void *b,
                    void *o, int64_t M, int64_t N, int64_t K, int64_t g, int64_t n0, int nc, int dt) {
    for (int64_t m0 = 0; m0 < M;) {
        const int r = M - m0 < I8_R ? (int)(M - m0) : I8_R;
        const float *xm = x + m0 * K;
        if (g == K) {
#if I8_R == 3
            if (r == 3)
                i8_tile_3(xm, q, ldq, s, lds, b, o, N, K, m0, n0, nc, dt);
            else
#endif
                if (r == 2)
                i8_tile_2(xm, q, ldq, s, lds, b, o, N, K, m0, n0, nc, dt);
            else
                i8_tile_1(xm, q, ldq, s, lds, b, o, N, K, m0, n0, nc, dt);
        } else {
#if I8_R == 3
            if (r == 3)
                i8g_tile_3(xm, q, ldq, s, lds, b, o, N, K, g, m0, n0, nc, dt);
            else
#endif
                if (r == 2)
                i8g_tile_2(xm, q, ldq, s, lds, b, o, N, K, g, m0, n0, nc, dt);
            else
                i8g_tile_1(xm, q, ldq, s, lds, b, o, N, K, g, m0, n0, nc, dt);
        }
        m0 += r;
    }
}

static void i4_rows(const float *x, const float *xs, const uint8_t *q, int64_t ldq, const float *s,
                    const float *mn, int64_t lds, const void *b, void *o, int64_t M, int64_t N, int64_t K,
                    int64_t g, int64_t n0, int nc, int dt) {
    const int64_t G = K / g;
    for (int64_t m0 = 0; m0 < M;) {
        const int r = M - m0 < I4_R ? (int)(M - m0) : I4_R;
        if (r == 2)
            i4_tile_2(x + m0 * K, xs + m0 * G, q, ldq, s, mn, lds, b, o, N, K, g, m0, n0, nc, dt);
        else
            i4_tile_1(x + m0 * K, xs + m0 * G, q, ldq, s, mn, lds, b, o, N, K, g, m0, n0, nc, dt);
        m0 += r;
    }
}

/* ---- int4, a few rows: channels dequantised to fp32 rows in L1, fp32 dot tiles over them ----- */

#define F32_R 3 /* 3 x 4, as i8_tile */

/* buf [C][K] = the dequantised int4 rows n0 .. n0 + nc - 1 (the rest repeat the last). */
static void deq_i4_rows(const uint8_t *q, int64_t ldq, const float *scales, const float *mins, int64_t lds,
                        int64_t K, int64_t g, int64_t n0, int nc, float *buf) {
    for (int c = 0; c < C; c++) {
        const int64_t n = n0 + (c < nc ? c : nc - 1);
        const uint8_t *row = q + n * ldq;
        const float *s = scales + n * lds, *m = mins + n * lds;
        const int64_t ahead = n0 + QL_PF * C + c; /* see i8_tile */
        const char *pf = (const char *)(q + ahead * ldq);
        __builtin_prefetch(scales + ahead * lds);
        __builtin_prefetch(mins + ahead * lds);
        float *o = buf + c * K;
        for (int64_t k = 0; k < K; k += 32) {
            __builtin_prefetch(pf + k / 2);
            const float sj = s[k / g], mj = m[k / g];
            for (int off = 0; off < 32; off += VL)
                vstore(o + k + off, nibbles(row + k / 2, off) * sj + mj);
        }
    }
}

/* R rows of x (from row m0) . the C dequantised rows in buf + bias -> out (channels n0 .. n0 + nc - 1). */
INLINE void f32_tile(const float *x, const float *buf, const void *bias, void *out, int64_t N, int64_t K,
                     int64_t m0, int64_t n0, int nc, int R, int dt) {
    vf acc[RMAX][C];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = vzero();
    const float *xr = x + m0 * K;
    for (int64_t k = 0; k < K; k += VL) { /* K % 32 == 0 */
        vf xv[RMAX];
        for (int r = 0; r < R; r++)
            xv[r] = vload(xr + r * K + k);
        for (int c = 0; c < C; c++) {
            const vf wv = vload(buf + c * K + k);
            for (int r = 0; r < R; r++)
                acc[r][c] += xv[r] * wv;
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < nc && c < C; c++) {
            const int64_t n = n0 + c;
            stv(out, (m0 + r) * N + n, vhsum(acc[r][c]) + (bias ? ldv(bias, n, dt) : 0.f), dt);
        }
}

#define F32_TILE(R)                                                                                         \
    static void f32_tile_##R(const float *x, const float *buf, const void *b, void *o, int64_t N,          \
                             int64_t K, int64_t m0, int64_t n0, int nc, int dt) {                          \
        if (dt)                                                                                             \
            f32_tile(x, buf, b, o, N, K, m0, n0, nc, R, 1);                                                 \
        else                                                                                                \
            f32_tile(x, buf, b, o, N, K, m0, n0, nc, R, 0);                                                 \
    }
F32_TILE(1)
F32_TILE(2)
F32_TILE(3)

/* The int4 layer this way. Returns -1 when out of memory. */
static int i4_deq_rows(const float *x, const uint8_t *q, int64_t ldq, const float *scales, const float *mins,
                       int64_t lds, const void *bias, void *out, int64_t M, int64_t N, int64_t K, int64_t g,
                       int dt, int nthreads) {
    const int64_t tiles = (N + C - 1) / C;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (M * N * K >= QL_PAR_MIN_WORK && tiles > 1)
    {
        float *buf = malloc(sizeof(float) * (size_t)(C * K));
        if (!buf) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < tiles; t++) {
                const int64_t n0 = t * C;
                const int nc = N - n0 < C ? (int)(N - n0) : C;
                deq_i4_rows(q, ldq, scales, mins, lds, K, g, n0, nc, buf);
                for (int64_t m0 = 0; m0 < M;) {
                    const int r = M - m0 < F32_R ? (int)(M - m0) : F32_R;
                    if (r == 3)
                        f32_tile_3(x, buf, bias, out, N, K, m0, n0, nc, dt);
                    else if (r == 2)
                        f32_tile_2(x, buf, bias, out, N, K, m0, n0, nc, dt);
                    else
                        f32_tile_1(x, buf, bias, out, N, K, m0, n0, nc, dt);
                    m0 += r;
                }
            }
        }
        free(buf);
    }
    return failed ? -1 : 0;
}

/* ---- many rows: dequantised, transposed panels and a broadcast micro-kernel ------------------- */

#define NR (2 * VL) /* output channels per panel: two vectors */
#define MR 6        /* rows per micro-tile: 12 accumulators + 2 weight vectors + 1 broadcast */

/* In-place transpose of VL vectors of VL (vector i becomes lane i of each). The shuffles are
 * unpack / shufps / vperm2f128 patterns (AVX) or unpack / movlhps ones (SSE2, NEON zip). */
INLINE void transpose(vf r[VL]) {
#if VL == 8
    vf t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = __builtin_shufflevector(r[i], r[i + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[i + 1] = __builtin_shufflevector(r[i], r[i + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int i = 0; i < 8; i += 4)
        for (int h = 0; h < 2; h++) {
            u[i + 2 * h] = __builtin_shufflevector(t[i + h], t[i + h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
            u[i + 2 * h + 1] = __builtin_shufflevector(t[i + h], t[i + h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        }
    for (int i = 0; i < 4; i++) {
        r[i] = __builtin_shufflevector(u[i], u[i + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        r[i + 4] = __builtin_shufflevector(u[i], u[i + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
#else
    const vf t0 = __builtin_shufflevector(r[0], r[1], 0, 4, 1, 5), t1 = __builtin_shufflevector(r[0], r[1], 2, 6, 3, 7);
    const vf t2 = __builtin_shufflevector(r[2], r[3], 0, 4, 1, 5), t3 = __builtin_shufflevector(r[2], r[3], 2, 6, 3, 7);
    r[0] = __builtin_shufflevector(t0, t2, 0, 1, 4, 5);
    r[1] = __builtin_shufflevector(t0, t2, 2, 3, 6, 7);
    r[2] = __builtin_shufflevector(t1, t3, 0, 1, 4, 5);
    r[3] = __builtin_shufflevector(t1, t3, 2, 3, 6, 7);
#endif
}

/* pk[k][c] = q[c][k] for the nc (<= NR) rows of q (ldq apart); columns nc.. are zero. */
static void pack_i8(const int8_t *q, int64_t ldq, int64_t K, int nc, float *pk) {
    const char *pf = (const char *)(q + 2 * NR * ldq); /* the panel after next: see i8_tile */
    int64_t k = 0;
    for (; k + VL <= K; k += VL) {
        for (int off = 0; off < NR * VL; off += 64)
            __builtin_prefetch(pf + NR * k + off);
        for (int h = 0; h < NR; h += VL) {
            vf r[VL];
            for (int i = 0; i < VL; i++)
                r[i] = h + i < nc ? ld_i8(q + (h + i) * ldq + k) : vzero();
            transpose(r);
            for (int i = 0; i < VL; i++)
                vstore(pk + (k + i) * NR + h, r[i]);
        }
    }
    for (; k < K; k++)
        for (int c = 0; c < NR; c++)
            pk[k * NR + c] = c < nc ? (float)q[c * ldq + k] : 0.f;
}

/* Group-wise int8: pk[k][c] = q[c][k] * scales[c][k / g] (g a multiple of VL dividing K, scales'
 * rows lds apart), the dequantised weight as the reference rounds it. Columns nc.. repeat column
 * nc - 1: finite, and gemm_tile does not store them. */
INLINE void pack_i8g_body(const int8_t *q, int64_t ldq, const float *scales, int64_t lds, int64_t g, int64_t K,
                          int nc, float *pk) {
    const char *pf = (const char *)(q + 2 * NR * ldq); /* the panel after next: see i8_tile */
    const char *pfs = (const char *)(scales + 2 * NR * lds);
    const int8_t *w[NR];
    const float *sc[NR];
    for (int c = 0; c < NR; c++) {
        const int cc = c < nc ? c : nc - 1;
        w[c] = q + cc * ldq;
        sc[c] = scales + cc * lds;
    }
    for (int64_t j = 0; j < K / g; j++) {
        __builtin_prefetch(pfs + j * 64);
        for (int64_t k = j * g; k < (j + 1) * g; k += VL) {
            for (int off = 0; off < NR * VL; off += 64)
                __builtin_prefetch(pf + NR * k + off);
            for (int h = 0; h < NR; h += VL) {
                vf r[VL];
                for (int i = 0; i < VL; i++)
                    r[i] = ld_i8(w[h + i] + k) * sc[h + i][j];
                transpose(r);
                for (int i = 0; i < VL; i++)
                    vstore(pk + (k + i) * NR + h, r[i]);
            }
        }
    }
}

static void pack_i8g(const int8_t *q, int64_t ldq, const float *scales, int64_t lds, int64_t g, int64_t K, int nc,
                     float *pk) {
    if (g == 32)
        pack_i8g_body(q, ldq, scales, lds, 32, K, nc, pk);
    else if (g == 64)
        pack_i8g_body(q, ldq, scales, lds, 64, K, nc, pk);
    else if (g == 128)
        pack_i8g_body(q, ldq, scales, lds, 128, K, nc, pk);
    else
        pack_i8g_body(q, ldq, scales, lds, g, K, nc, pk);
}

/* pk[k][c] = q[c][k] * scales[c][k / g] + mins[c][k / g], dequantised as the reference does (up
 * to fp32 rounding: one fused multiply-add here, two roundings in torch). */
static void pack_i4(const uint8_t *q, int64_t ldq, const float *scales, const float *mins, int64_t lds,
                    int64_t K, int64_t g, int nc, float *pk) {
    /* the panel after next (see i8_tile): NR * 16 bytes of q a step, and its scales and mins */
    const char *pf = (const char *)(q + 2 * NR * ldq);
    const char *pfs = (const char *)(scales + 2 * NR * lds), *pfm = (const char *)(mins + 2 * NR * lds);
    for (int64_t k = 0; k < K; k += 32) {
        const int64_t j = k / g;
        for (int off = 0; off < NR * 16; off += 64)
            __builtin_prefetch(pf + NR * k / 2 + off);
        __builtin_prefetch(pfs + k * 64 / g);
        __builtin_prefetch(pfm + k * 64 / g);
        for (int h = 0; h < NR; h += VL)
            for (int off = 0; off < 32; off += VL) {
                vf r[VL];
                for (int i = 0; i < VL; i++) {
                    const int c = h + i;
                    r[i] = c < nc ? nibbles(q + c * ldq + k / 2, off) * scales[c * lds + j] + mins[c * lds + j]
                                  : vzero();
                }
                transpose(r);
                for (int i = 0; i < VL; i++)
                    vstore(pk + (k + off + i) * NR + h, r[i]);
            }
    }
}

/* Rows m0 .. m0 + R - 1 of the output over one panel (channels n0 .. n0 + nc - 1):
 * out = (x . pk) * cs + cb, with cs / cb the panel's column scales / biases (NR floats each). */
INLINE void gemm_tile(const float *x, const float *pk, const float *cs, const float *cb, void *out, int64_t N,
                      int64_t K, int64_t m0, int64_t n0, int nc, int R, int dt) {
    vf a0[MR], a1[MR];
    for (int r = 0; r < R; r++)
        a0[r] = a1[r] = vzero();
    const float *xr = x + m0 * K;
    for (int64_t k = 0; k < K; k++) {
        const vf w0 = vload(pk + k * NR), w1 = vload(pk + k * NR + VL);
        for (int r = 0; r < R; r++) {
            const vf xb = vset1(xr[r * K + k]);
            a0[r] += xb * w0;
            a1[r] += xb * w1;
        }
    }
    const vf s0 = vload(cs), s1 = vload(cs + VL), b0 = vload(cb), b1 = vload(cb + VL);
    for (int r = 0; r < R; r++) {
        const vf o0 = a0[r] * s0 + b0, o1 = a1[r] * s1 + b1;
        const int64_t off = (m0 + r) * N + n0;
        if (nc == NR && !dt) {
            vstore((float *)out + off, o0);
            vstore((float *)out + off + VL, o1);
        } else {
            float tmp[NR];
            vstore(tmp, o0);
            vstore(tmp + VL, o1);
            for (int c = 0; c < nc; c++)
                stv(out, off + c, tmp[c], dt);
        }
    }
}

#define GEMM_TILE(R)                                                                                        \
    static void gemm_tile_##R(const float *x, const float *pk, const float *cs, const float *cb, void *o,  \
                              int64_t N, int64_t K, int64_t m0, int64_t n0, int nc, int dt) {              \
        if (dt)                                                                                             \
            gemm_tile(x, pk, cs, cb, o, N, K, m0, n0, nc, R, 1);                                            \
        else                                                                                                \
            gemm_tile(x, pk, cs, cb, o, N, K, m0, n0, nc, R, 0);                                            \
    }
GEMM_TILE(1)
GEMM_TILE(2)
GEMM_TILE(3)
GEMM_TILE(4)
GEMM_TILE(5)
GEMM_TILE(6)

typedef void (*gemm_fn)(const float *, const float *, const float *, const float *, void *, int64_t, int64_t,
                        int64_t, int64_t, int, int);
static const gemm_fn GEMM_TILES[MR + 1] = {NULL, gemm_tile_1, gemm_tile_2, gemm_tile_3, gemm_tile_4, gemm_tile_5,
                                           gemm_tile_6};

/* ---- many rows, bf16 activations on AVX512_BF16: the GEMM on bf16 dot products ---------------- */
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define HAVE_BF16_GEMM 1
/* The fp32 GEMM above multiplies at the fp32 FMA rate; where the CPU has vdpbf16ps (two bf16
 * products summed into each fp32 lane, twice the fp32 rate) and the activations are bf16 anyway,
 * the panels hold the dequantised weights as bf16 pairs instead and x is read as it is. Per-channel
 * int8 panels hold q exactly (|q| <= 127 is a bf16 integer) and the scales go on the sums, so that
 * layout loses nothing; group-wise int8 and int4 panels round each dequantised weight to bf16
 * (relative error <= 2^-9, the precision the bf16 model's own weights have). */
#define BNR 32 /* output channels per panel: two vectors of 16 fp32 lanes */
#define BMR 8  /* rows per micro-tile: 16 accumulators (12 rows and 24 measured the same) */

/* In-place transpose of 16 vectors of 16 32-bit lanes (vector i becomes lane i of each). */
INLINE void transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* each 128-bit lane of r[i] now holds a 4 x 4 block transposed; gather the lanes */
    for (int i = 0; i < 4; i++) {
        t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
        t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
        t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
        t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
    }
    for (int i = 0; i < 4; i++) {
        r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
        r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
        r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
        r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
    }
}

INLINE __m512 bf_i8x16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

/* k0 .. k0 + 31 of channel row ``c`` as 16 bf16 pairs (lane i: k0 + 2i, k0 + 2i + 1). mode 0:
 * int8 q as it is; 1: int8 q * scale; 2: int4 q * scale + min (the run's 16 bytes at q). */
INLINE __m512i bf_run(const void *q, int mode, float s, float m) {
    __m512 lo, hi;
    if (mode == 2) {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
        lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15))), _mm512_set1_ps(s),
                             _mm512_set1_ps(m));
        hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)), _mm512_set1_ps(s), _mm512_set1_ps(m));
    } else {
        lo = bf_i8x16((const int8_t *)q);
        hi = bf_i8x16((const int8_t *)q + 16);
        if (mode == 1) {
            lo = _mm512_mul_ps(lo, _mm512_set1_ps(s));
            hi = _mm512_mul_ps(hi, _mm512_set1_ps(s));
        }
    }
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
}

/* pk[j][c] = the bf16 pair (k = 2j, 2j + 1) of channel c, for the nc (<= BNR) channels at q (K a
 * multiple of 32); channels nc.. repeat channel nc - 1 (finite, never stored). */
INLINE void pack_bf16_panel(const void *q, int64_t ldq, const float *scales, const float *mins, int64_t lds,
                            int64_t g, int64_t K, int nc, int mode, uint32_t *pk) {
    for (int h = 0; h < BNR; h += 16)
        for (int64_t k = 0; k < K; k += 32) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                const int64_t c = h + i < nc ? h + i : nc - 1;
                const int64_t j = k / g;
                if (mode == 2)
                    r[i] = bf_run((const uint8_t *)q + c * ldq + k / 2, 2, scales[c * lds + j], mins[c * lds + j]);
                else
                    r[i] = bf_run((const int8_t *)q + c * ldq + k, mode, mode ? scales[c * lds + j] : 1.f, 0.f);
            }
            transpose16(r);
            for (int i = 0; i < 16; i++)
                _mm512_storeu_si512(pk + (k / 2 + i) * BNR + h, r[i]);
        }
}

INLINE uint32_t ld_pair(const uint16_t *p) {
    uint32_t u;
    memcpy(&u, p, sizeof u);
    return u;
}

/* Rows m0 .. m0 + R - 1 of out (bf16) over one panel: (x . pk) * cs + cb. */
INLINE void bf_tile(const uint16_t *x, const uint32_t *pk, const float *cs, const float *cb, uint16_t *out,
                    int64_t N, int64_t K, int64_t m0, int64_t n0, int nc, int R) {
    __m512 a0[BMR], a1[BMR];
    for (int r = 0; r < R; r++)
        a0[r] = a1[r] = _mm512_setzero_ps();
    const uint16_t *xr = x + m0 * K;
    for (int64_t j = 0; j < K / 2; j++) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512(pk + j * BNR);
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512(pk + j * BNR + 16);
        for (int r = 0; r < R; r++) {
            const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)ld_pair(xr + r * K + 2 * j));
            a0[r] = _mm512_dpbf16_ps(a0[r], xb, w0);
            a1[r] = _mm512_dpbf16_ps(a1[r], xb, w1);
        }
    }
    const __m512 s0 = _mm512_loadu_ps(cs), s1 = _mm512_loadu_ps(cs + 16);
    const __m512 b0 = _mm512_loadu_ps(cb), b1 = _mm512_loadu_ps(cb + 16);
    for (int r = 0; r < R; r++) {
        const __m512 o0 = _mm512_fmadd_ps(a0[r], s0, b0), o1 = _mm512_fmadd_ps(a1[r], s1, b1);
        uint16_t *o = out + (m0 + r) * N + n0;
        if (nc == BNR) {
            _mm256_storeu_si256((__m256i *)o, (__m256i)_mm512_cvtneps_pbh(o0));
            _mm256_storeu_si256((__m256i *)(o + 16), (__m256i)_mm512_cvtneps_pbh(o1));
        } else {
            float tmp[BNR];
            _mm512_storeu_ps(tmp, o0);
            _mm512_storeu_ps(tmp + 16, o1);
            for (int c = 0; c < nc; c++)
                o[c] = to_bf16_bits(tmp[c]);
        }
    }
}

#define BF_TILE(R)                                                                                          \
    static void bf_tile_##R(const uint16_t *x, const uint32_t *pk, const float *cs, const float *cb,        \
                            uint16_t *o, int64_t N, int64_t K, int64_t m0, int64_t n0, int nc) {            \
        bf_tile(x, pk, cs, cb, o, N, K, m0, n0, nc, R);                                                     \
    }
BF_TILE(1)
BF_TILE(2)
BF_TILE(3)
BF_TILE(4)
BF_TILE(5)
BF_TILE(6)
BF_TILE(7)
BF_TILE(8)

typedef void (*bf_fn)(const uint16_t *, const uint32_t *, const float *, const float *, uint16_t *, int64_t,
                      int64_t, int64_t, int64_t, int);
static const bf_fn BF_TILES[BMR + 1] = {NULL, bf_tile_1, bf_tile_2, bf_tile_3, bf_tile_4,
                                        bf_tile_5, bf_tile_6, bf_tile_7, bf_tile_8};

#endif

/* The GEMM over all panels; int8 when mins is NULL (q int8: per channel when g == K, the scales
 * applied to the sums, else group-wise, the panels dequantised), else int4 (panels dequantised).
 * bf: on bf16 dot products (x and out bf16, K a multiple of 32; only where HAVE_BF16_GEMM), else
 * fp32 (x fp32, out of dtype dt). Returns -1 when out of memory. */
static int gemm(const void *x, const void *q, int64_t ldq, const float *scales, const float *mins, int64_t lds,
                const void *bias, void *out, int64_t M, int64_t N, int64_t K, int64_t g, int dt, int nthreads,
                int bf) {
    const int channel = !mins && g == K;
#ifdef HAVE_BF16_GEMM
    const int nr = bf ? BNR : NR;
    const size_t fp32_bytes = sizeof(float) * (size_t)((K + 15) / 16 * 16) * NR;
    const size_t bytes = bf ? sizeof(uint32_t) * (size_t)(K / 2) * BNR : fp32_bytes;
#else
    const int nr = NR;
    const size_t bytes = sizeof(float) * (size_t)((K + 15) / 16 * 16) * NR;
    (void)bf;
#endif
    const int64_t panels = (N + nr - 1) / nr;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (M * N * K >= QL_PAR_MIN_WORK && panels > 1)
    {
        void *pk = aligned_alloc(64, bytes);
        if (!pk) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp barrier
        if (!failed) {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < panels; p++) {
                const int64_t n0 = p * nr;
                const int nc = N - n0 < nr ? (int)(N - n0) : nr;
                float cs[32], cb[32]; /* a panel's column scales and biases: NR or BNR <= 32 */
                for (int c = 0; c < nr; c++) {
                    cs[c] = c < nc && channel ? scales[(n0 + c) * lds] : 1.f;
                    cb[c] = c < nc && bias ? ldv(bias, n0 + c, dt) : 0.f;
                }
#ifdef HAVE_BF16_GEMM
                if (bf) {
                    const int mode = mins ? 2 : channel ? 0 : 1;
                    const void *qp = mins ? (const void *)((const uint8_t *)q + n0 * ldq)
                                          : (const void *)((const int8_t *)q + n0 * ldq);
                    pack_bf16_panel(qp, ldq, scales + n0 * lds, mins ? mins + n0 * lds : NULL, lds, g, K, nc, mode,
                                    pk);
                    for (int64_t m0 = 0; m0 < M; m0 += BMR) {
                        const int r = M - m0 < BMR ? (int)(M - m0) : BMR;
                        BF_TILES[r](x, pk, cs, cb, out, N, K, m0, n0, nc);
                    }
                    continue;
                }
#endif
                if (mins)
                    pack_i4((const uint8_t *)q + n0 * ldq, ldq, scales + n0 * lds, mins + n0 * lds, lds, K, g, nc,
                            pk);
                else if (channel)
                    pack_i8((const int8_t *)q + n0 * ldq, ldq, K, nc, pk);
                else
                    pack_i8g((const int8_t *)q + n0 * ldq, ldq, scales + n0 * lds, lds, g, K, nc, pk);
                for (int64_t m0 = 0; m0 < M; m0 += MR) {
                    const int r = M - m0 < MR ? (int)(M - m0) : MR;
                    GEMM_TILES[r](x, pk, cs, cb, out, N, K, m0, n0, nc, dt);
                }
            }
        }
        free(pk);
    }
    return failed ? -1 : 0;
}

/* ---- entry points ----------------------------------------------------------------------------- */

/* out [M, N] = x [M, K] . dequant(q [N, K], scales)^T + bias [N] (bias may be NULL); x, bias, out
 * of dtype dt (0 fp32, 1 bf16) and contiguous; invariant: the GEMM for every M (its sums run over k
 * in one order per output, so a row's bits do not depend on M; the dot tiles reduce across lanes); q's rows are ldq >= K bytes apart (a view narrowed
 * along K). g == K: per channel, channel n's scale at scales[n * lds]; else group-wise, g a
 * multiple of 32 dividing K, scales [N, K/g] with rows lds >= K/g floats apart. Returns 0, or -1
 * (nothing written) when out of memory or for a group size it cannot run. */
int baton_linear_int8(const void *x, const int8_t *q, const float *scales, const void *bias, void *out,
                      int64_t M, int64_t N, int64_t K, int64_t g, int64_t ldq, int64_t lds, int dt, int nthreads,
                      int invariant) {
    if (M <= 0 || N <= 0)
        return 0;
    if (g != K && (g <= 0 || g % 32 || K % g))
        return -1;
    const int use_gemm = invariant || M >= (g == K ? QL_GEMM_MIN_M_INT8 : QL_GEMM_MIN_M_INT8G);
#ifdef HAVE_BF16_GEMM
    if (dt && K % 32 == 0 && use_gemm)
        return gemm(x, q, ldq, scales, NULL, lds, bias, out, M, N, K, g, dt, nthreads, 1);
#endif
    float *xbuf;
    const float *xf = fp32_rows(x, M * K, dt, &xbuf);
    if (!xf)
        return -1;
    int rc = 0;
    if (use_gemm) {
        rc = gemm(xf, q, ldq, scales, NULL, lds, bias, out, M, N, K, g, dt, nthreads, 0);
    } else {
        const int64_t tiles = (N + C - 1) / C;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * N * K >= QL_PAR_MIN_WORK)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * C;
            i8_rows(xf, q, ldq, scales, lds, bias, out, M, N, K, g, n0, N - n0 < C ? (int)(N - n0) : C, dt);
        }
    }
    free(xbuf);
    return rc;
}

/* out [M, N] = x [M, K] . dequant(q [N, K/2], scales, mins [N, K/g])^T + bias [N]; g is a multiple
 * of 32 dividing K; q's rows are ldq >= K/2 bytes apart, those of scales and mins lds >= K/g
 * floats. Same dtypes and return as baton_linear_int8 (and -1 for a group size it cannot run). */
int baton_linear_int4(const void *x, const uint8_t *q, const float *scales, const float *mins, const void *bias,
                      void *out, int64_t M, int64_t N, int64_t K, int64_t g, int64_t ldq, int64_t lds, int dt,
                      int nthreads, int invariant) {
    if (M <= 0 || N <= 0)
        return 0;
    if (g <= 0 || g % 32 || K % g)
        return -1;
    const int use_gemm = invariant || M >= QL_GEMM_MIN_M_INT4;
#ifdef HAVE_BF16_GEMM
    if (dt && use_gemm) /* K % g == 0 and g % 32 == 0: K is a multiple of 32 */
        return gemm(x, q, ldq, scales, mins, lds, bias, out, M, N, K, g, dt, nthreads, 1);
#endif
    float *xbuf;
    const float *xf = fp32_rows(x, M * K, dt, &xbuf);
    if (!xf)
        return -1;
    int rc = 0;
    if (use_gemm) {
        rc = gemm(xf, q, ldq, scales, mins, lds, bias, out, M, N, K, g, dt, nthreads, 0);
    } else if (M >= QL_ROWS_MIN_M_INT4) {
        rc = i4_deq_rows(xf, q, ldq, scales, mins, lds, bias, out, M, N, K, g, dt, nthreads);
    } else {
        const int64_t G = K / g;
        float *xs = malloc(sizeof(float) * (size_t)(M * G + 1));
        if (!xs) {
            free(xbuf);
            return -1;
        }
        for (int64_t m = 0; m < M; m++) /* sums of x over each group, for the mins term */
            for (int64_t j = 0; j < G; j++) {
                const float *p = xf + m * K + j * g;
                vf s = vzero();
                for (int64_t k = 0; k < g; k += VL)
                    s += vload(p + k);
                xs[m * G + j] = vhsum(s);
            }
        const int64_t tiles = (N + C - 1) / C;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (M * N * K >= QL_PAR_MIN_WORK)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * C;
            i4_rows(xf, xs, q, ldq, scales, mins, lds, bias, out, M, N, K, g, n0, N - n0 < C ? (int)(N - n0) : C,
                    dt);
        }
        free(xs);
    }
    free(xbuf);
    return rc;
}
