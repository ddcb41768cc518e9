/* Vectors of the CPU's own width by GCC's vector extensions, shared by runtime/cpu_decode.c and cpu_rows.c: the
   compiler maps them onto AVX512F, AVX2 and FMA, or NEON. */

#ifndef KVGATE_CPU_VEC_H
#define KVGATE_CPU_VEC_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_bf16.h"

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8 /* a vector of 16 would be split, and passed between functions in memory */
#endif
#define MOST (256 / LANES) /* vectors a row of the widest head */
#define INLINE static inline __attribute__((always_inline))
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));
typedef uint16_t vh __attribute__((vector_size(2 * LANES)));
typedef uint32_t vu __attribute__((vector_size(4 * LANES)));

static inline vf load(const float *p) {
    vf x;
    memcpy(&x, p, sizeof x);
    return x;
}

static inline void save(float *p, vf x) { memcpy(p, &x, sizeof x); }

static inline vf splat(float x) { return (vf){} + x; }

static inline vf exp_neg(vf x) { /* e^x for x <= 0, ~1 ulp; below -87: ~0 */
    vi low = x < -87.0f;
    x = (vf)(((vi)x & ~low) | ((vi)splat(-87.0f) & low));
    vf n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest */
    vf f = x - n * 0.693145751953125f;
    f = f - n * 1.428606765330187e-06f;
    vf p = splat(1.0f / 5040);
    p = p * f + 1.0f / 720;
    p = p * f + 1.0f / 120;
    p = p * f + 1.0f / 24;
    p = p * f + 1.0f / 6;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    vi bits = (__builtin_convertvector(n, vi) + 127) << 23;
    return p * (vf)bits;
}

static inline float total(vf a) { /* the lanes' sum, halving: no chain of dependent adds */
#if LANES == 16
    a = a + __builtin_shuffle(a, (vi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    a = a + __builtin_shuffle(a, (vi){4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
    a = a + __builtin_shuffle(a, (vi){2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
#else
    a = a + __builtin_shuffle(a, (vi){4, 5, 6, 7, 0, 1, 2, 3});
    a = a + __builtin_shuffle(a, (vi){2, 3, 0, 1, 6, 7, 4, 5});
#endif
    return a[0] + a[1];
}

/* a[0..LANES) each summed: lane r of the result holds a[r]'s sum. Pairs are halved together, each of a pair's
   halves into one vector, so that LANES sums take LANES - 1 of those steps where `total` took log2(LANES) each. */
INLINE vf totals(vf *a) {
#if LANES == 16
    static const vi lo[4] = {{0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                             {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27},
                             {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29},
                             {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}};
    static const int halves[4] = {8, 4, 2, 1};
#else
    static const vi lo[3] = {{0, 1, 2, 3, 8, 9, 10, 11}, {0, 1, 4, 5, 8, 9, 12, 13}, {0, 2, 4, 6, 8, 10, 12, 14}};
    static const int halves[3] = {4, 2, 1};
#endif
    for (int level = 0, n = LANES; n > 1; level++, n /= 2)
        for (int i = 0; i < n / 2; i++)
            a[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo[level]) +
                   __builtin_shuffle(a[2 * i], a[2 * i + 1], lo[level] + halves[level]);
    return a[0];
}

INLINE vf get(const void *p, int64_t i, int bf16) { /* LANES elements from p[i] as float32 */
    if (!bf16) return load((const float *)p + i);
    vh h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    return (vf)(__builtin_convertvector(h, vu) << 16);
}

INLINE vu bf16_bits(vf x) { /* round to nearest even in the high half; NaN stays NaN (cpu_bf16.h's to_bf16) */
    vu u = (vu)x;
    vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    vu even = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (even & ~nan) | (((u >> 16) | 0x40u) & nan);
}

INLINE vf rounded(vf x, int bf16) { return bf16 ? (vf)(bf16_bits(x) << 16) : x; }

INLINE void set(void *p, int64_t i, vf x, int bf16) {
    if (!bf16) {
        save((float *)p + i, x);
        return;
    }
    vh h = __builtin_convertvector(bf16_bits(x), vh);
    memcpy((uint16_t *)p + i, &h, sizeof h);
}

static inline float element(const void *p, int64_t i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void put(void *p, int64_t i, float f, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = to_bf16(f);
    else
        ((float *)p)[i] = f;
}

#endif
