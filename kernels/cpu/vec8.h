/* Shared by the CPU kernels: 8-lane fp32 vectors in GCC's generic vector extensions, for builds
 * without AVX-512. The compiler maps them to one AVX2 register on x86-64-v3, two SSE registers on
 * baseline x86-64 and two NEON registers on aarch64, so one source serves every CPU that lacks
 * the AVX-512 paths. Include after <stdint.h>, <string.h> and the INLINE macro. */
#ifndef BATON_VEC8_H
#define BATON_VEC8_H

#pragma GCC diagnostic ignored "-Wpsabi" /* 32-byte vectors without AVX: internal functions only */

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
typedef uint32_t v8u __attribute__((vector_size(32)));
typedef uint16_t v8h __attribute__((vector_size(16)));

/* Keeps the compiler from re-associating across this point (the build has -fassociative-math):
 * exp's range reduction must subtract n*ln2 in two exact steps, not one rounded product. */
#if defined(__x86_64__) && defined(__AVX__)
#define V8_BARRIER(v) __asm__("" : "+x"(v))
#else /* a 32-byte vector fits no single SSE/NEON register: go through memory */
#define V8_BARRIER(v) __asm__("" : "+m"(v))
#endif

INLINE v8f v8_set1(float x) { return (v8f){x, x, x, x, x, x, x, x}; }
INLINE v8f v8_zero(void) { return (v8f){0}; }

INLINE v8f v8_load(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v); /* unaligned; compiles to one vector load */
    return v;
}

INLINE void v8_store(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* Lanes where m is all ones take a, the others b. */
INLINE v8f v8_select(v8i m, v8f a, v8f b) { return (v8f)((m & (v8i)a) | (~m & (v8i)b)); }
INLINE v8f v8_max(v8f a, v8f b) { return v8_select(a > b, a, b); }
INLINE v8f v8_min(v8f a, v8f b) { return v8_select(a < b, a, b); }

INLINE float v8_hsum(v8f v) { return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7])); }

INLINE float v8_hmax(v8f v) {
    float m = v[0];
    for (int i = 1; i < 8; i++)
        m = v[i] > m ? v[i] : m;
    return m;
}

/* 8 bf16 values widened to fp32 (exact). */
INLINE v8f v8_load_bf16(const uint16_t *p) {
    v8h h;
    memcpy(&h, p, sizeof h);
    return (v8f)(__builtin_convertvector(h, v8u) << 16);
}

/* bf16 bits of x in the low half of each lane, rounded as to_bf16_bits: nearest-even,
 * NaN -> 0x7FC0, subnormals kept. */
INLINE v8u v8_bf16_bits(v8f x) {
    const v8u u = (v8u)x;
    const v8u r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16;
    const v8i nan = x != x;
    return (v8u)(((v8i)r & ~nan) | (nan & 0x7FC0));
}

INLINE void v8_store_bf16(uint16_t *p, v8f x) {
    const v8h h = __builtin_convertvector(v8_bf16_bits(x), v8h);
    memcpy(p, &h, sizeof h);
}

/* x rounded to bf16 and widened back (what a bf16 tensor would hold). */
INLINE v8f v8_round_bf16(v8f x) { return (v8f)(v8_bf16_bits(x) << 16); }

/* e^x to ~1e-7 relative on [-87.3, 88.3], clamped outside: x = n ln2 + r, |r| <= ln2/2,
 * degree-7 Taylor polynomial for e^r, then scale by 2^n through the exponent bits. */
INLINE v8f v8_exp(v8f x) {
    x = v8_min(v8_max(x, v8_set1(-87.3f)), v8_set1(88.3f));
    /* floor(y + 0.5) by truncation of a positive value: n in [-126, 127] */
    const v8i n = __builtin_convertvector(x * 1.44269504f + 128.5f, v8i) - 128;
    const v8f nf = __builtin_convertvector(n, v8f);
    v8f r = x - nf * 0.693145751953125f; /* the high part of ln2 has few bits: exact product */
    V8_BARRIER(r);
    r = r - nf * 1.42860682e-6f;
    v8f p = v8_set1(1.f / 5040);
    p = p * r + 1.f / 720;
    p = p * r + 1.f / 120;
    p = p * r + 1.f / 24;
    p = p * r + 1.f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    return p * (v8f)((n + 127) << 23);
}

/* ---- Below: helpers for the element-wise ops (elementwise.c). ---- */

/* Whether any lane of a comparison mask is set: the cheap test that lets a search skip 8 lanes. */
INLINE int v8_any(v8i m) {
    uint64_t w[4];
    memcpy(w, &m, sizeof w);
    return (w[0] | w[1] | w[2] | w[3]) != 0;
}

/* The even elements, and the odd ones, of the 16 in a then b. (__builtin_shufflevector is
 * clang's spelling; GCC has it only from 12 on.) */
#if defined(__clang__)
INLINE v8f v8_evens(v8f a, v8f b) { return __builtin_shufflevector(a, b, 0, 2, 4, 6, 8, 10, 12, 14); }
INLINE v8f v8_odds(v8f a, v8f b) { return __builtin_shufflevector(a, b, 1, 3, 5, 7, 9, 11, 13, 15); }
#else
INLINE v8f v8_evens(v8f a, v8f b) { return __builtin_shuffle(a, b, (v8i){0, 2, 4, 6, 8, 10, 12, 14}); }
INLINE v8f v8_odds(v8f a, v8f b) { return __builtin_shuffle(a, b, (v8i){1, 3, 5, 7, 9, 11, 13, 15}); }
#endif

#endif
