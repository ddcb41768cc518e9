/* A decode step's attention on a CPU, every sequence and KV head of the batch in one call (runtime/decode.py
   holds the batch; runtime/cpu_attention.py builds and calls this). Per layer it replaces a dozen torch ops (the
   new rows written, two batched matmuls at a few hundred keys, masks, softmax, conversions), each of which
   cost more in dispatch than in arithmetic at these sizes. GCC's vector extensions: the compiler maps them onto
   the CPU's own vectors (AVX512F, AVX2 and FMA, NEON). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__ARM_NEON)
int decode_fast(void) { return 1; }
#else
int decode_fast(void) { return 0; }
#endif

#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8 /* a vector of 16 would be split, and passed between functions in memory */
#endif
#define MOST (256 / LANES) /* vectors a row of the widest head */
typedef float vf __attribute__((vector_size(4 * LANES)));
typedef int32_t vi __attribute__((vector_size(4 * LANES)));

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

static inline float element(const void *p, int64_t i, int bf16) {
    return bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void put(void *p, int64_t i, float f, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = to_bf16(f);
    else
        ((float *)p)[i] = f;
}

/* q [batch, heads, d], k and v [batch, kv_heads, d] (the step's new rows; sequences `qs`, `kstride`, `vstride`
   elements apart, heads d apart), out [batch, heads, d] contiguous: float32, or bf16 where `bf16`; keys and values
   float32 [batch, kv_heads, room, d], sequence b's rows 0 .. ends[b] - 1 filled.
   Writes each new row at ends[b], then attends over rows 0 .. ends[b] (the last `window` of them; 0: all). d a
   multiple of 16 and at most 256. Returns 0; -1 when out of memory. */
int decode(int bf16, const void *q, int64_t qs, const void *k, int64_t kstride, const void *v, int64_t vstride,
           float *keys, float *values, const int64_t *ends, void *out, int batch, int heads, int kv_heads, int room,
           int d, float scale, int window, int threads) {
    int group = heads / kv_heads, failed = 0, chunks = d / LANES;
#pragma omp parallel num_threads(threads)
    {
        float *s = malloc(sizeof(float) * ((size_t)group * room + LANES));
        if (s == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int it = 0; it < batch * kv_heads; it++) {
            if (s == NULL) continue;
            int b = it / kv_heads, h = it % kv_heads, end = (int)ends[b];
            int first = window > 0 && end - window + 1 > 0 ? end - window + 1 : 0, n = end + 1 - first;
            float *ks = keys + ((int64_t)it * room) * d, *vs = values + ((int64_t)it * room) * d;
            for (int e = 0; e < d; e++) {
                ks[(int64_t)end * d + e] = element(k, b * kstride + (int64_t)h * d + e, bf16);
                vs[(int64_t)end * d + e] = element(v, b * vstride + (int64_t)h * d + e, bf16);
            }
            vf qv[16][MOST]; /* the group's queries (at most 16 heads a group, 256 wide), scaled */
            for (int g = 0; g < group; g++)
                for (int c = 0; c < chunks; c++) {
                    float x[LANES];
                    for (int i = 0; i < LANES; i++)
                        x[i] = element(q, b * qs + (int64_t)(h * group + g) * d + c * LANES + i, bf16) * scale;
                    qv[g][c] = load(x);
                }
            for (int j = 0; j < n; j++) {
                const float *row = ks + (int64_t)(first + j) * d;
                for (int g = 0; g < group; g++) {
                    vf a = qv[g][0] * load(row);
                    for (int c = 1; c < chunks; c++) a = a + qv[g][c] * load(row + c * LANES);
                    s[g * room + j] = total(a);
                }
            }
            for (int g = 0; g < group; g++) {
                float *sg = s + g * room, top = -INFINITY, sum = 0.0f;
                for (int j = 0; j < n; j++) top = fmaxf(top, sg[j]);
                int j = 0;
                vf all = {};
                for (; j + LANES <= n; j += LANES) {
                    vf p = exp_neg(load(sg + j) - top);
                    save(sg + j, p);
                    all = all + p;
                }
                sum = total(all);
                for (; j < n; j++) sum += sg[j] = expf(sg[j] - top);
                float inv = 1.0f / sum;
                for (j = 0; j < n; j++) sg[j] *= inv;
            }
            vf acc[16][MOST];
            for (int g = 0; g < group; g++)
                for (int c = 0; c < chunks; c++) acc[g][c] = (vf){};
            for (int j = 0; j < n; j++) {
                const float *row = vs + (int64_t)(first + j) * d;
                for (int c = 0; c < chunks; c++) {
                    vf x = load(row + c * LANES);
                    for (int g = 0; g < group; g++) acc[g][c] = acc[g][c] + splat(s[g * room + j]) * x;
                }
            }
            for (int g = 0; g < group; g++)
                for (int c = 0; c < chunks; c++)
                    for (int i = 0; i < LANES; i++)
                        put(out, ((int64_t)b * heads + h * group + g) * d + c * LANES + i, acc[g][c][i], bf16);
        }
        free(s);
    }
    return failed ? -1 : 0;
}

/* The rest of a decode step's small ops, for its few rows (a prompt's rows keep torch's, whose sums run in
   another order: the same rows must compute alike whatever step holds them). */

static inline float rounded(float f, int bf16) { /* f as the element type holds it */
    if (!bf16) return f;
    uint16_t h;
    put(&h, 0, f, 1);
    return element(&h, 0, 1);
}

/* out [n, d] = w * x / rms(x) for rows of x [n, d] (`stride` elements apart), as transformers' RMSNorm: in float32,
   rounded to the element type before the weight multiplies. */
void rms_norm(int bf16, const void *x, int64_t stride, const void *w, void *out, int n, int d, float eps) {
    for (int r = 0; r < n; r++) {
        vf sums = {};
        int e = 0;
        for (; e + LANES <= d; e += LANES) {
            float h[LANES];
            for (int i = 0; i < LANES; i++) h[i] = element(x, r * stride + e + i, bf16);
            vf v = load(h);
            sums = sums + v * v;
        }
        float sum = total(sums);
        for (; e < d; e++) sum += element(x, r * stride + e, bf16) * element(x, r * stride + e, bf16);
        float inv = 1.0f / sqrtf(sum / d + eps);
        for (e = 0; e < d; e++) {
            float y = rounded(element(x, r * stride + e, bf16) * inv, bf16) * element(w, e, bf16);
            put(out, (int64_t)r * d + e, y, bf16);
        }
    }
}

/* out [n, heads, d] contiguous = x cos + rotate_half(x) sin for x [n, heads, d] (rows `stride` elements apart,
   heads d apart), cos and sin [n, d] contiguous; each product rounded to the element type, as torch's ops do. */
void rope(int bf16, const void *x, int64_t stride, const void *cos, const void *sin, void *out, int n, int heads,
          int d) {
    int half = d / 2;
    for (int r = 0; r < n; r++)
        for (int h = 0; h < heads; h++) {
            int64_t at = r * stride + (int64_t)h * d, to = ((int64_t)r * heads + h) * d;
            for (int e = 0; e < d; e++) {
                float turned = e < half ? -element(x, at + e + half, bf16) : element(x, at + e - half, bf16);
                float c = element(cos, (int64_t)r * d + e, bf16), s = element(sin, (int64_t)r * d + e, bf16);
                float a = rounded(element(x, at + e, bf16) * c, bf16), b = rounded(turned * s, bf16);
                put(out, to + e, a + b, bf16);
            }
        }
}
