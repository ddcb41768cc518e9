/* bf16 to and from float32 as the CPU kernels convert them (cpu_attention.c, cpu_decode.c). */

#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float from_bf16(bf16 x) {
    uint32_t u = (uint32_t)x << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline bf16 to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    return (bf16)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
