/* Shared by the CPU kernels: fp32 -> bf16 bits the way torch rounds (nearest-even, NaN -> 0x7FC0,
 * subnormals kept). Include after <stdint.h> and <string.h>. */
#ifndef BATON_BF16_H
#define BATON_BF16_H

static inline uint16_t to_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if (f != f)
        return 0x7FC0;
    return (uint16_t)((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

#endif
