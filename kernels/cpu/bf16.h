/* Shared by the CPU kernels: bf16 bits <-> fp32, rounding the way torch does (nearest-even,
 * NaN -> 0x7FC0, subnormals kept). Include after <stdint.h> and <string.h>. */
#ifndef BATON_BF16_H
#define BATON_BF16_H

static inline uint16_t to_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f)
        return 0x7FC0;
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

static inline float bf16_to_f32(uint16_t x) {
    const uint32_t bits = (uint32_t)x << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#endif
