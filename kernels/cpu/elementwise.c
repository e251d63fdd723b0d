/* Fused element-wise ops of a decoder layer (RMSNorm, residual add + RMSNorm, Neox RoPE,
 * SiLU-and-mul): one pass over each row instead of a chain of torch ops, fp32 math inside,
 * bf16 (dt = 1) or fp32 (dt = 0) tensors outside. Rounding follows kernels/reference.py: a
 * result is rounded to the tensor dtype where the reference materialises a tensor of that dtype
 * (the residual sum; silu before the multiply), nowhere else. bf16 rounding is round-to-nearest
 * -even with NaN -> 0x7FC0, as torch does it, and keeps subnormals.
 *
 * Each row function has an AVX-512 body for 16 elements at a time, or on AVX2 builds a body in
 * vec8.h's 8-lane generic vectors, and a scalar loop for the tail and for other CPUs. Rows are
 * split over OpenMP threads only when there is enough work to pay for waking them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))
#include "bf16.h"
#define PAR_MIN_ELEMS 24576 /* below this a parallel region costs more than the work it splits */

/* vec8's 8-lane vectors are one register only with AVX2. On SSE2 and NEON, GCC 12 keeps a 32-byte
 * vector that a loop carries (a sum, a running max) in memory and compares it lane by lane, which
 * makes the vec8 bodies slower than the scalar loops, which GCC vectorises itself at the native
 * width (all but silu's expf): those builds keep the scalar loops. */
#if !defined(__AVX512F__) && defined(__AVX2__)
#define VEC8_BODIES 1
#endif

INLINE float ld(const void *p, int64_t i, int dt) {
    return dt ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

INLINE float round_dt(float f, int dt) {
    return dt ? bf16_to_f32(to_bf16_bits(f)) : f;
}

INLINE void st(void *p, int64_t i, float f, int dt) {
    if (dt)
        ((uint16_t *)p)[i] = to_bf16_bits(f);
    else
        ((float *)p)[i] = f;
}

#if defined(__AVX512F__)
INLINE __m512 vld(const void *p, int64_t i, int dt) {
    if (!dt)
        return _mm512_loadu_ps((const float *)p + i);
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* bf16 bits (in the low 16 of each 32-bit lane) of x, rounded like to_bf16_bits. */
INLINE __m512i vbf16_bits(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
}

/* x rounded to bf16, 16 values packed. vcvtneps2bf16 rounds the same way but reads subnormal
 * inputs as zero and keeps NaN payloads: lanes that are rare in practice, redone the slow way. */
INLINE __m256i vbf16_pack(__m512 x) {
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
    const __m256i r = (__m256i)_mm512_cvtneps_pbh(x);
    if (__builtin_expect(_mm512_fpclass_ps_mask(x, 0xA1) == 0, 1))  /* 0xA1: NaN or subnormal */
        return r;
#endif
    return _mm512_cvtepi32_epi16(vbf16_bits(x));
}

INLINE __m512 vround_dt(__m512 x, int dt) {
    return dt ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(vbf16_pack(x)), 16)) : x;
}

INLINE void vst(void *p, int64_t i, __m512 x, int dt) {
    if (dt)
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), vbf16_pack(x));
    else
        _mm512_storeu_ps((float *)p + i, x);
}

/* vst that also returns the value as stored (rounded), converting once. */
INLINE __m512 vst_rounded(void *p, int64_t i, __m512 x, int dt) {
    if (!dt) {
        _mm512_storeu_ps((float *)p + i, x);
        return x;
    }
    const __m256i b = vbf16_pack(x);
    _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), b);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

#include "vexp.h"
#elif defined(VEC8_BODIES)
#include "vec8.h"

INLINE v8f round8_dt(v8f x, int dt) { return dt ? v8_round_bf16(x) : x; }

/* 16 elements as two vectors: fp32 in order, bf16 as the even elements and the odd ones. Each
 * 32-bit word of bf16 data holds an even element in its low half and the odd one above (x86 is
 * little-endian), so this widens with a shift and a mask, without v8_load_bf16's lane shuffles,
 * and st16 packs back without v8_store_bf16's. For ops that pair elements of equal index only. */
INLINE void ld16(const void *p, int64_t i, int dt, v8f *a, v8f *b) {
    if (dt) {
        v8u u;
        memcpy(&u, (const uint16_t *)p + i, sizeof u);
        *a = (v8f)(u << 16);
        *b = (v8f)(u & 0xFFFF0000u);
    } else {
        *a = v8_load((const float *)p + i);
        *b = v8_load((const float *)p + i + 8);
    }
}

/* 16 fp32 values in the order ld16 reads dtype dt, to pair with its vectors element by element. */
INLINE void ld16_order(const float *p, int dt, v8f *a, v8f *b) {
    const v8f u = v8_load(p), v = v8_load(p + 8);
    if (dt) {
        *a = v8_evens(u, v);
        *b = v8_odds(u, v);
    } else {
        *a = u;
        *b = v;
    }
}

INLINE void st16(void *p, int64_t i, v8f a, v8f b, int dt) {
    if (dt) {
        const v8u u = v8_bf16_bits(a) | v8_bf16_bits(b) << 16;
        memcpy((uint16_t *)p + i, &u, sizeof u);
    } else {
        v8_store((float *)p + i, a);
        v8_store((float *)p + i + 8, b);
    }
}
#endif

/* One row of (residual add +) RMSNorm. With r, y = round(x + r) goes to rout and is normalised. */
INLINE void rms_row(const void *x, const void *r, void *out, void *rout, const float *w, int H,
                    float eps, int dt) {
    float ss = 0.f;
    int i = 0;
    const void *y = r ? rout : x;
#if defined(__AVX512F__)
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= H; i += 16) {
        __m512 v = vld(x, i, dt);
        if (r)
            v = vst_rounded(rout, i, _mm512_add_ps(v, vld(r, i, dt)), dt);
        acc = _mm512_fmadd_ps(v, v, acc);
    }
    ss = _mm512_reduce_add_ps(acc);
#elif defined(VEC8_BODIES)
    /* 16 at a time (ld16's order; two sums also halve the add latency the loop waits on) */
    v8f acc0 = v8_zero(), acc1 = v8_zero();
    for (; i + 16 <= H; i += 16) {
        v8f v0, v1;
        ld16(x, i, dt, &v0, &v1);
        if (r) {
            v8f r0, r1;
            ld16(r, i, dt, &r0, &r1);
            v0 += r0;
            v1 += r1;
            st16(rout, i, v0, v1, dt); /* rounds as round8_dt does: the compiler shares the work */
            v0 = round8_dt(v0, dt);
            v1 = round8_dt(v1, dt);
        }
        acc0 += v0 * v0;
        acc1 += v1 * v1;
    }
    ss = v8_hsum(acc0 + acc1);
#endif
    for (; i < H; i++) {
        float v = ld(x, i, dt);
        if (r) {
            v = round_dt(v + ld(r, i, dt), dt);
            st(rout, i, v, dt);
        }
        ss += v * v;
    }
    const float inv = 1.f / sqrtf(ss / (float)H + eps);
    i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= H; i += 16)
        vst(out, i, _mm512_mul_ps(_mm512_mul_ps(vld(y, i, dt), _mm512_set1_ps(inv)), _mm512_loadu_ps(w + i)),
            dt);
#elif defined(VEC8_BODIES)
    for (; i + 16 <= H; i += 16) { /* w is stored in ld16's order (rms_weight_index) */
        v8f y0, y1;
        ld16(y, i, dt, &y0, &y1);
        st16(out, i, y0 * inv * v8_load(w + i), y1 * inv * v8_load(w + i + 8), dt);
    }
#endif
    for (; i < H; i++)
        st(out, i, ld(y, i, dt) * inv * w[i], dt);
}

/* Where rms_row reads weight i: in ld16's order within each full block of 16 on vec8 builds. */
INLINE int rms_weight_index(int i, int H, int dt) {
#if defined(VEC8_BODIES)
    if (dt && i < H / 16 * 16) {
        const int k = i % 16;
        return i - k + (k < 8 ? 2 * k : 2 * k - 15); /* evens 0..14, then odds 1..15 */
    }
#else
    (void)H, (void)dt;
#endif
    return i;
}

/* out = rms_norm(x) or (rms_norm(x + r), x + r into rout); x, r, out, rout are [rows, H]
 * contiguous of dtype dt; w [H] of dtype w_dt. Returns 0, or -1 when out of memory. */
int baton_rms_norm(const void *x, const void *r, void *out, void *rout, const void *w, int64_t rows,
                   int H, int dt, int w_dt, float eps, int nthreads) {
    float stack_w[1024];
    float *wf = H <= 1024 ? stack_w : malloc(sizeof(float) * (size_t)H);
    if (!wf)
        return -1;
    for (int i = 0; i < H; i++)
        wf[i] = ld(w, rms_weight_index(i, H, dt), w_dt);
    const size_t esz = dt ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * H >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        const size_t off = (size_t)t * H * esz;
        if (dt)
            rms_row((const char *)x + off, r ? (const char *)r + off : NULL, (char *)out + off,
                    r ? (char *)rout + off : NULL, wf, H, eps, 1);
        else
            rms_row((const char *)x + off, r ? (const char *)r + off : NULL, (char *)out + off,
                    r ? (char *)rout + off : NULL, wf, H, eps, 0);
    }
    if (wf != stack_w)
        free(wf);
    return 0;
}

/* Neox rotation of one head: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s) over the two halves, from
 * element i of each on. */
INLINE void rope_head(const void *x, void *o, const float *cs, int half, int i, int dt) {
#if defined(__AVX512F__)
    for (; i + 16 <= half; i += 16) {
        const __m512 c = _mm512_loadu_ps(cs + i), s = _mm512_loadu_ps(cs + half + i);
        const __m512 x1 = vld(x, i, dt), x2 = vld(x, half + i, dt);
        vst(o, i, _mm512_sub_ps(_mm512_mul_ps(x1, c), _mm512_mul_ps(x2, s)), dt);
        vst(o, half + i, _mm512_add_ps(_mm512_mul_ps(x2, c), _mm512_mul_ps(x1, s)), dt);
    }
#endif
    for (; i < half; i++) {
        const float c = cs[i], s = cs[half + i], x1 = ld(x, i, dt), x2 = ld(x, half + i, dt);
        st(o, i, x1 * c - x2 * s, dt);
        st(o, half + i, x2 * c + x1 * s, dt);
    }
}

INLINE void rope_heads(const char *x, char *o, const float *cs, int H, int D, int dt) {
    const size_t hb = (size_t)D * (dt ? 2 : 4);
    const int half = D / 2;
    int i = 0;
#if defined(VEC8_BODIES)
    /* 16 elements of each half of every head at a time: their cos and sin, put in ld16's order
     * once, serve all H heads */
    for (; i + 16 <= half; i += 16) {
        v8f c0, c1, s0, s1;
        ld16_order(cs + i, dt, &c0, &c1);
        ld16_order(cs + half + i, dt, &s0, &s1);
        for (int h = 0; h < H; h++) {
            v8f a0, a1, b0, b1;
            ld16(x + h * hb, i, dt, &a0, &a1);
            ld16(x + h * hb, half + i, dt, &b0, &b1);
            st16(o + h * hb, i, a0 * c0 - b0 * s0, a1 * c1 - b1 * s1, dt);
            st16(o + h * hb, half + i, b0 * c0 + a0 * s0, b1 * c1 + a1 * s1, dt);
        }
    }
#endif
    for (int h = 0; h < H; h++)
        rope_head(x + h * hb, o + h * hb, cs, half, i, dt);
}

/* Neox RoPE over the full head dim: q [T, Hq, D] and k [T, Hkv, D] with heads contiguous and
 * rows q_stride / k_stride elements apart -> contiguous qo, ko. cs is the fp32 [max_pos, D]
 * cos|sin table. Returns -1 (writing nothing) if a position is outside [0, max_pos). */
int baton_rope_neox(const int64_t *pos, const void *q, const void *k, void *qo, void *ko,
                    const float *cs, int64_t T, int Hq, int Hkv, int D, int64_t q_stride,
                    int64_t k_stride, int64_t max_pos, int dt, int nthreads) {
    for (int64_t t = 0; t < T; t++)
        if (pos[t] < 0 || pos[t] >= max_pos)
            return -1;
    const size_t esz = dt ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * (Hq + Hkv) * D >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        const float *c = cs + pos[t] * D;
        const char *qi = (const char *)q + t * q_stride * esz, *ki = (const char *)k + t * k_stride * esz;
        char *qd = (char *)qo + t * Hq * D * esz, *kd = (char *)ko + t * Hkv * D * esz;
        if (dt) {
            rope_heads(qi, qd, c, Hq, D, 1);
            rope_heads(ki, kd, c, Hkv, D, 1);
        } else {
            rope_heads(qi, qd, c, Hq, D, 0);
            rope_heads(ki, kd, c, Hkv, D, 0);
        }
    }
    return 0;
}

#if defined(VEC8_BODIES)
/* round(silu(a)). Past v8_exp's clamp (-a > 88.3) e^-a is taken as inf, as expf overflows to it
 * near there: silu(a) is then -0 (NaN for -inf) like the scalar loop's and torch's, not a / 2^127. */
INLINE v8f silu8(v8f a, int dt) {
    const v8f e = v8_select(-a > 88.3f, v8_set1(INFINITY), v8_exp(-a));
    return round8_dt(a / (1.f + e), dt);
}
#endif

/* out[t, i] = round(round(silu(a)) * b) with a = x[t, i], b = x[t, I + i] (one rounding per
 * tensor the reference materialises; no-ops in fp32). */
INLINE void silu_row(const void *x, void *o, int I, int dt) {
    int i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= I; i += 16) {
        const __m512 a = vld(x, i, dt);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), a));
        const __m512 s = vround_dt(_mm512_div_ps(a, _mm512_add_ps(one, e)), dt);
        vst(o, i, _mm512_mul_ps(s, vld(x, I + i, dt)), dt);
    }
#elif defined(VEC8_BODIES)
    for (; i + 16 <= I; i += 16) {
        v8f a0, a1, b0, b1;
        ld16(x, i, dt, &a0, &a1);
        ld16(x, I + i, dt, &b0, &b1);
        st16(o, i, silu8(a0, dt) * b0, silu8(a1, dt) * b1, dt);
    }
#endif
    for (; i < I; i++) {
        const float a = ld(x, i, dt);
        st(o, i, round_dt(a / (1.f + expf(-a)), dt) * ld(x, I + i, dt), dt);
    }
}

/* x [rows, 2I] contiguous -> out [rows, I]. */
void baton_silu_and_mul(const void *x, void *out, int64_t rows, int I, int dt, int nthreads) {
    const size_t esz = dt ? 2 : 4;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * I >= PAR_MIN_ELEMS)
    for (int64_t t = 0; t < rows; t++) {
        const char *xi = (const char *)x + (size_t)t * 2 * I * esz;
        char *oi = (char *)out + (size_t)t * I * esz;
        if (dt)
            silu_row(xi, oi, I, 1);
        else
            silu_row(xi, oi, I, 0);
    }
}

/* bf16 logits [rows, V] -> fp32 out, and per row the columns within `margin` output ulps of the
 * row's max (ulp = 2^(floor(log2(max(|max|, 1e-3))) - 7), as kernels/reference.py computes it):
 * the entries whose order bf16 rounding may have changed. cand [rows, max_cands] gets the
 * columns in ascending order, counts [rows] how many. One pass converts and finds the max, a
 * second (over the fp32 row, still in cache) collects. Returns 0, or -1 if a row has more than
 * max_cands candidates (the caller then uses the reference). */
int baton_logits_candidates(const uint16_t *in, float *out, int32_t *cand, int32_t *counts, int64_t rows,
                            int64_t V, int64_t max_cands, float margin, int nthreads) {
    int overflow = 0;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * V >= PAR_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const uint16_t *x = in + r * V;
        float *o = out + r * V;
        float m = -INFINITY;
        int64_t i = 0;
#if defined(__AVX512F__)
        __m512 vm = _mm512_set1_ps(-INFINITY);
        for (; i + 16 <= V; i += 16) {
            const __m512 v = vld(x, i, 1);
            _mm512_storeu_ps(o + i, v);
            vm = _mm512_max_ps(vm, v);
        }
        m = _mm512_reduce_max_ps(vm);
#elif defined(VEC8_BODIES)
        v8f vm = v8_set1(-INFINITY);
        for (; i + 8 <= V; i += 8) {
            const v8f v = v8_load_bf16(x + i);
            v8_store(o + i, v);
            vm = v8_max(v, vm); /* v first: a NaN is skipped, as in the scalar loop */
        }
        m = v8_hmax(vm);
#endif
        for (; i < V; i++) {
            o[i] = ld(x, i, 1);
            m = o[i] > m ? o[i] : m;
        }
        const float a = fabsf(m) > 1e-3f ? fabsf(m) : 1e-3f;
        const float thr = m - margin * ldexpf(1.f, (int)floorf(log2f(a)) - 7);
        int64_t n = 0;
        i = 0;
#if defined(__AVX512F__)
        const __m512 vt = _mm512_set1_ps(thr);
        for (; i + 16 <= V; i += 16) {
            __mmask16 k = _mm512_cmp_ps_mask(_mm512_loadu_ps(o + i), vt, _CMP_GE_OQ);
            while (k) {
                const int j = __builtin_ctz(k);
                if (n < max_cands)
                    cand[r * max_cands + n] = (int32_t)(i + j);
                n++;
                k &= k - 1;
            }
        }
#elif defined(VEC8_BODIES)
        for (; i + 8 <= V; i += 8)
            if (v8_any(v8_load(o + i) >= thr)) /* rare: a handful of columns per row */
                for (int j = 0; j < 8; j++)
                    if (o[i + j] >= thr) {
                        if (n < max_cands)
                            cand[r * max_cands + n] = (int32_t)(i + j);
                        n++;
                    }
#endif
        for (; i < V; i++)
            if (o[i] >= thr) {
                if (n < max_cands)
                    cand[r * max_cands + n] = (int32_t)i;
                n++;
            }
        counts[r] = (int32_t)(n < max_cands ? n : max_cands);
        if (n > max_cands) {
            _Pragma("omp atomic write")
            overflow = 1;
        }
    }
    return overflow ? -1 : 0;
}

/* Paged KV write: token t's K and V rows (row elements each; consecutive tokens ks / vs elements
 * apart, so views into a fused QKV output need no copy) go to slot slots[t] of the caches
 * ([nslots, row] when flattened); a negative slot is a padding token and is skipped. Returns 0,
 * or -1 without writing anything if a slot is past the cache (the caller's reference raises). */
int baton_write_kv(const void *k, const void *v, void *kc, void *vc, const int64_t *slots, int64_t T,
                   int64_t row, int64_t ks, int64_t vs, int64_t nslots, int dt, int nthreads) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= nslots)
            return -1;
    const size_t esz = dt ? 2 : 4, bytes = (size_t)row * esz;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T * row >= 4 * PAR_MIN_ELEMS)
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0)
            continue;
        memcpy((char *)kc + (size_t)slots[t] * bytes, (const char *)k + (size_t)t * ks * esz, bytes);
        memcpy((char *)vc + (size_t)slots[t] * bytes, (const char *)v + (size_t)t * vs * esz, bytes);
    }
    return 0;
}

/* Row-wise argmax of fp32 [rows, cols] (row stride ld) with torch's semantics: the first index of
 * the maximum, and the first NaN if a row has one. torch's CPU argmax is a scalar loop; here one
 * vector pass finds the max (and any NaN), a second the first index holding it (8 lanes at a
 * time on AVX2 builds, a scalar loop elsewhere). */
void baton_argmax_f32(const float *x, int64_t *out, int64_t rows, int64_t cols, int64_t ld, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (rows * cols >= 8 * PAR_MIN_ELEMS)
    for (int64_t r = 0; r < rows; r++) {
        const float *p = x + r * ld;
        float m = -INFINITY;
        int nan = 0;
        int64_t i = 0;
#if defined(__AVX512F__)
        __m512 vm = _mm512_set1_ps(-INFINITY);
        __mmask16 un = 0;
        for (; i + 16 <= cols; i += 16) {
            const __m512 v = _mm512_loadu_ps(p + i);
            un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
            vm = _mm512_max_ps(vm, v);
        }
        m = _mm512_reduce_max_ps(vm);
        nan = un != 0;
#elif defined(VEC8_BODIES)
        v8f vm = v8_set1(-INFINITY);
        v8i un = {0};
        for (; i + 8 <= cols; i += 8) {
            const v8f v = v8_load(p + i);
            un |= v != v;
            vm = v8_max(v, vm);
        }
        m = v8_hmax(vm);
        nan = v8_any(un);
#endif
        for (; i < cols; i++) {
            nan |= p[i] != p[i];
            m = p[i] > m ? p[i] : m;
        }
        i = 0;
#if defined(VEC8_BODIES)
        /* skip the blocks of 8 without a hit; the scalar loop finds the first in the one that has */
        for (; i + 8 <= cols; i += 8) {
            const v8f v = v8_load(p + i);
            if (v8_any(nan ? v != v : v == m))
                break;
        }
#endif
        int64_t best = 0;
        for (; i < cols; i++)
            if (nan ? p[i] != p[i] : p[i] == m) {
                best = i;
                break;
            }
        out[r] = best;
    }
}
