/* Paged decode attention for CPUs: one query token per sequence, read straight from the block
 * table (no gather copy, no padding to the longest sequence), online softmax in fp32.
 * One task per (sequence, KV head); the G query heads sharing that KV head are done together so
 * each K/V row is read once. Built by kernels/cpu_ops.py with -O3 -march=native -fopenmp.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_G 16
#define MAX_D 256
#define MAX_BS 128

static inline float bf16_to_f32(uint16_t x) {
    uint32_t bits = ((uint32_t)x) << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define DEFINE_DECODE(NAME, T, LOAD)                                                            \
void NAME(const float *restrict q, const T *restrict kc, const T *restrict vc,                  \
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
                m[g] = -1e30f; l[g] = 0.f; /* finite: exp(m - mx) must be 0, never NaN */                                                     \
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
DEFINE_DECODE(paged_decode_bf16, uint16_t, LOAD_BF16)
DEFINE_DECODE(paged_decode_f32, float, LOAD_F32)

int baton_cpu_abi_version(void) { return 1; }
