/* Shared by the vec8 attention kernels (paged_attention.c, prefill_attention.c): helpers on top of
 * vec8.h. Include after vec8.h. */
#ifndef BATON_VEC8_ATTENTION_H
#define BATON_VEC8_ATTENTION_H

#if defined(__AVX2__)
#include <immintrin.h>
#endif

/* Keep a vector that several FMAs share in a register: left alone, GCC folds its load into each
 * FMA as a memory operand, and the reloads, not the FMAs, become the bound (prefill ran 1.5x
 * slower that way). Only x86 has memory operands on vector arithmetic. */
#if defined(__x86_64__) && defined(__AVX__)
#define V8_IN_REG(v) __asm__("" : "+x"(v))
#else
#define V8_IN_REG(v) (void)0
#endif

/* 1 where the vector registers hold only 8 v8f values (x86 without AVX: 16 xmm, two per v8f);
 * AVX (16 ymm) and aarch64 (32 NEON registers) hold 16. The micro-kernels size their
 * accumulator tiles by it: tiles sized for 16 spill on SSE and run several times slower. */
#if defined(__x86_64__) && !defined(__AVX__)
#define V8_NARROW 1
#else
#define V8_NARROW 0
#endif

/* Loop-carried accumulators. Where a v8f does not fit one register (SSE, NEON), GCC 12 keeps a
 * 32-byte vector that a loop carries in memory: every iteration loads, adds and stores it, and
 * the micro-kernels ran 5x slower. Two native halves stay in registers. On AVX it is a v8f. */
#if defined(__AVX__)
typedef v8f v8acc;
INLINE v8acc v8acc_of(v8f x) { return x; }
INLINE v8f v8acc_get(v8acc a) { return a; }
INLINE v8acc v8acc_fma(v8acc a, v8f b, v8f x) { return a + b * x; }
#else
typedef float v8half __attribute__((vector_size(16)));
typedef struct {
    v8half lo, hi;
} v8acc;
INLINE v8acc v8acc_of(v8f x) {
    v8acc a;
    memcpy(&a, &x, sizeof a);
    return a;
}
INLINE v8f v8acc_get(v8acc a) {
    v8f x;
    memcpy(&x, &a, sizeof x);
    return x;
}
INLINE v8acc v8acc_fma(v8acc a, v8f b, v8f x) {
    const v8acc bb = v8acc_of(b), xx = v8acc_of(x);
    a.lo += bb.lo * xx.lo;
    a.hi += bb.hi * xx.hi;
    return a;
}
#endif

/* 8 bf16 values widened to fp32, as v8_load_bf16. GCC splits the generic widening into two
 * 128-bit halves on AVX2 (6 instructions); one 256-bit vpmovzxwd and a shift do it there. */
INLINE v8f v8_widen_bf16(const uint16_t *p) {
#if defined(__AVX2__)
    return (v8f)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
    return v8_load_bf16(p);
#endif
}

/* 8 consecutive cache elements (bf16 or fp32) at element index i, as fp32. */
INLINE v8f v8_load_kv(const void *p, size_t i, int bf16) {
    return bf16 ? v8_widen_bf16((const uint16_t *)p + i) : v8_load((const float *)p + i);
}

#endif
