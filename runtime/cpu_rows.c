/* A layer's row-wise ops on a CPU, for a decode step's few rows and a prompt's thousands alike (runtime/model.py
   calls them through runtime/cpu_attention.py): RMSNorm, the rotation of q and k, the SiLU-gated product of the
   MLP. Each replaces several torch ops, each a pass over the rows' memory (a cold 2.6k-token float32 prefill spent
   ~0.4 s in them). Every row is computed by the same operations whatever rows share its call and however many
   threads run it, and every product is rounded to the element type where torch's ops round it. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

#define ROWS_APART(n, width) if ((int64_t)(n) * (width) >= (1 << 15)) /* threads only where the work pays for them */

INLINE float one(float x, int bf16) { return bf16 ? from_bf16(to_bf16(x)) : x; }

INLINE void norm_row(int bf16, const void *x, const void *w, void *out, int64_t at, int64_t to, int d, float eps) {
    vf sums = {};
    int e = 0;
    for (; e + LANES <= d; e += LANES) {
        vf v = get(x, at + e, bf16);
        sums = sums + v * v;
    }
    float sum = total(sums);
    for (int t = e; t < d; t++) sum += element(x, at + t, bf16) * element(x, at + t, bf16);
    float inv = 1.0f / sqrtf(sum / d + eps);
    for (e = 0; e + LANES <= d; e += LANES)
        set(out, to + e, rounded(get(x, at + e, bf16) * inv, bf16) * get(w, e, bf16), bf16);
    for (; e < d; e++) put(out, to + e, one(element(x, at + e, bf16) * inv, bf16) * element(w, e, bf16), bf16);
}

/* out [n, d] = w * x / rms(x) for rows of x [n, d] (`stride` elements apart), as transformers' RMSNorm: in float32,
   rounded to the element type before the weight multiplies. */
void rms_norm(int bf16, const void *x, int64_t stride, const void *w, void *out, int n, int d, float eps,
              int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) ROWS_APART(n, d)
    for (int r = 0; r < n; r++) {
        if (bf16)
            norm_row(1, x, w, out, r * stride, (int64_t)r * d, d, eps);
        else
            norm_row(0, x, w, out, r * stride, (int64_t)r * d, d, eps);
    }
}

INLINE void rope_row(int bf16, const void *x, const void *cos, const void *sin, void *out, int64_t at, int64_t to,
                     int64_t cs, int d) {
    int half = d / 2, e = 0;
    if (half % LANES == 0)
        for (; e < d; e += LANES) {
            int lower = e < half;
            vf turned = get(x, at + (lower ? e + half : e - half), bf16);
            vf c = get(cos, cs + e, bf16), s = get(sin, cs + e, bf16);
            vf a = rounded(get(x, at + e, bf16) * c, bf16), b = rounded(turned * s, bf16);
            set(out, to + e, lower ? a - b : a + b, bf16);
        }
    for (; e < d; e++) {
        float turned = e < half ? -element(x, at + e + half, bf16) : element(x, at + e - half, bf16);
        float a = one(element(x, at + e, bf16) * element(cos, cs + e, bf16), bf16);
        put(out, to + e, a + one(turned * element(sin, cs + e, bf16), bf16), bf16);
    }
}

/* out [n, heads, d] contiguous = x cos + rotate_half(x) sin for x [n, heads, d] (rows `stride` elements apart,
   heads d apart), cos and sin [n, d] contiguous; each product rounded to the element type, as torch's ops do. */
void rope(int bf16, const void *x, int64_t stride, const void *cos, const void *sin, void *out, int n, int heads,
          int d, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) ROWS_APART(n, heads * d)
    for (int r = 0; r < n; r++)
        for (int h = 0; h < heads; h++) {
            int64_t at = r * stride + (int64_t)h * d, to = ((int64_t)r * heads + h) * d, cs = (int64_t)r * d;
            if (bf16)
                rope_row(1, x, cos, sin, out, at, to, cs, d);
            else
                rope_row(0, x, cos, sin, out, at, to, cs, d);
        }
}

INLINE vf silu(vf g, int bf16) { /* g / (1 + e^-g), e^-|g| computed alone so that it never overflows */
    vi up = g >= 0.0f;
    vf t = exp_neg(-(vf)((vi)g & 0x7fffffff));              /* e^-|g| */
    vf over = (vf)(((vi)splat(1.0f) & up) | ((vi)t & ~up)); /* 1 where g >= 0, else e^g */
    return rounded(g * over / (1.0f + t), bf16);
}

INLINE void gated_row(int bf16, const void *x, void *out, int64_t at, int64_t to, int f) {
    int e = 0;
    for (; e + LANES <= f; e += LANES)
        set(out, to + e, silu(get(x, at + e, bf16), bf16) * get(x, at + f + e, bf16), bf16);
    for (; e < f; e++) {
        float g = element(x, at + e, bf16);
        put(out, to + e, one(g / (1.0f + expf(-g)), bf16) * element(x, at + f + e, bf16), bf16);
    }
}

/* out [n, f] = silu(gate) * up for rows of x [n, 2f] (gate, then up; rows `stride` elements apart), as torch's
   SiLU and product: each rounded to the element type. */
void silu_mul(int bf16, const void *x, int64_t stride, void *out, int n, int f, int threads) {
#pragma omp parallel for schedule(static) num_threads(threads) ROWS_APART(n, f)
    for (int r = 0; r < n; r++) {
        if (bf16)
            gated_row(1, x, out, r * stride, (int64_t)r * f, f);
        else
            gated_row(0, x, out, r * stride, (int64_t)r * f, f);
    }
}
