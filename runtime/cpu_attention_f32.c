/* The float32 kind of runtime/cpu_attention.c: dots and weighted sums by fused multiply-adds in float32 (AVX512F
   where the compiler targets it; the same operations in the same order in C elsewhere, which any CPU runs). */

#include <stdint.h>
#include <string.h>

#include "cpu_flash.h"

#ifdef __AVX512F__
#define FAST 1
#else
#define FAST 0
#endif

#define TILE 6 /* rows a tile: 6 x 4 accumulators and 4 loaded vectors fill 28 of the 32 registers */

/* Keys of head h, block b, transposed: kp[p * BLOCK + j] = K[j][p]; values as they are: vp[j * d + e] = V[j][e].
   Rows past `total` are zeros. */
static void pack(const void *kk, const void *vv, int64_t row, int total, int d, int b, void *kpp, void *vpp) {
    const float *k = kk, *v = vv;
    float *kp = kpp, *vp = vpp;
    for (int j = 0; j < BLOCK; j++) {
        int t = b * BLOCK + j;
        const float *kr = k + (int64_t)t * row;
        for (int p = 0; p < d; p++) kp[p * BLOCK + j] = t < total ? kr[p] : 0.0f;
        if (t < total)
            memcpy(vp + (int64_t)j * d, v + (int64_t)t * row, sizeof(float) * d);
        else
            memset(vp + (int64_t)j * d, 0, sizeof(float) * d);
    }
}

#if FAST
static void scores(const void *qq, int r0, int r1, const void *kpp, int d, float *s) {
    const float *q = qq, *kp = kpp;
    int r = r0;
    for (; r + TILE <= r1; r += TILE) {
        __m512 a[TILE][4];
        for (int i = 0; i < TILE; i++)
            for (int c = 0; c < 4; c++) a[i][c] = _mm512_setzero_ps();
        for (int p = 0; p < d; p++) {
            __m512 k0 = _mm512_loadu_ps(kp + p * BLOCK), k1 = _mm512_loadu_ps(kp + p * BLOCK + 16);
            __m512 k2 = _mm512_loadu_ps(kp + p * BLOCK + 32), k3 = _mm512_loadu_ps(kp + p * BLOCK + 48);
            for (int i = 0; i < TILE; i++) {
                __m512 x = _mm512_set1_ps(q[(r + i) * d + p]);
                a[i][0] = _mm512_fmadd_ps(x, k0, a[i][0]);
                a[i][1] = _mm512_fmadd_ps(x, k1, a[i][1]);
                a[i][2] = _mm512_fmadd_ps(x, k2, a[i][2]);
                a[i][3] = _mm512_fmadd_ps(x, k3, a[i][3]);
            }
        }
        for (int i = 0; i < TILE; i++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + (r + i) * BLOCK + 16 * c, a[i][c]);
    }
    for (; r < r1; r++) {
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int p = 0; p < d; p++) {
            __m512 x = _mm512_set1_ps(q[r * d + p]);
            for (int c = 0; c < 4; c++) a[c] = _mm512_fmadd_ps(x, _mm512_loadu_ps(kp + p * BLOCK + 16 * c), a[c]);
        }
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + r * BLOCK + 16 * c, a[c]);
    }
}

static void weigh(const void *ww, int r0, int r1, const void *vpp, int d, float *o) {
    const float *w = ww, *vp = vpp;
    for (int e0 = 0; e0 < d; e0 += 64) {
        int r = r0;
        for (; r + TILE <= r1; r += TILE) {
            __m512 a[TILE][4];
            for (int i = 0; i < TILE; i++)
                for (int c = 0; c < 4; c++) a[i][c] = _mm512_loadu_ps(o + (r + i) * d + e0 + 16 * c);
            for (int j = 0; j < BLOCK; j++) {
                const float *vr = vp + j * d + e0;
                __m512 v0 = _mm512_loadu_ps(vr), v1 = _mm512_loadu_ps(vr + 16);
                __m512 v2 = _mm512_loadu_ps(vr + 32), v3 = _mm512_loadu_ps(vr + 48);
                for (int i = 0; i < TILE; i++) {
                    __m512 x = _mm512_set1_ps(w[(r + i) * BLOCK + j]);
                    a[i][0] = _mm512_fmadd_ps(x, v0, a[i][0]);
                    a[i][1] = _mm512_fmadd_ps(x, v1, a[i][1]);
                    a[i][2] = _mm512_fmadd_ps(x, v2, a[i][2]);
                    a[i][3] = _mm512_fmadd_ps(x, v3, a[i][3]);
                }
            }
            for (int i = 0; i < TILE; i++)
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + (r + i) * d + e0 + 16 * c, a[i][c]);
        }
        for (; r < r1; r++) {
            __m512 a[4];
            for (int c = 0; c < 4; c++) a[c] = _mm512_loadu_ps(o + r * d + e0 + 16 * c);
            for (int j = 0; j < BLOCK; j++) {
                __m512 x = _mm512_set1_ps(w[r * BLOCK + j]);
                for (int c = 0; c < 4; c++) a[c] = _mm512_fmadd_ps(x, _mm512_loadu_ps(vp + j * d + e0 + 16 * c), a[c]);
            }
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + r * d + e0 + 16 * c, a[c]);
        }
    }
}

static float fold(float *s, int valid, float scale, float *m, float *l, void *w) {
    __m512 x[4];
    float alpha = softmax_step(s, valid, scale, m, l, x);
    for (int c = 0; c < 4; c++) _mm512_storeu_ps((float *)w + 16 * c, x[c]);
    return alpha;
}

#else /* the same method in plain C */

static void scores(const void *qq, int r0, int r1, const void *kpp, int d, float *s) {
    const float *q = qq, *kp = kpp;
    for (int r = r0; r < r1; r++)
        for (int j = 0; j < BLOCK; j++) {
            float a = 0.0f;
            for (int p = 0; p < d; p++) a = fmaf(q[r * d + p], kp[p * BLOCK + j], a);
            s[r * BLOCK + j] = a;
        }
}

static void weigh(const void *ww, int r0, int r1, const void *vpp, int d, float *o) {
    const float *w = ww, *vp = vpp;
    for (int r = r0; r < r1; r++)
        for (int e = 0; e < d; e++) {
            float a = o[r * d + e];
            for (int j = 0; j < BLOCK; j++) a = fmaf(w[r * BLOCK + j], vp[j * d + e], a);
            o[r * d + e] = a;
        }
}

static float fold(float *s, int valid, float scale, float *m, float *l, void *w) {
    float alpha = softmax_plain(s, valid, scale, m, l);
    memcpy(w, s, sizeof(float) * BLOCK);
    return alpha;
}
#endif

static void store(const float *o, float l, int d, void *dst) {
    for (int e = 0; e < d; e++) ((float *)dst)[e] = o[e] / l;
}

const struct kind F32 = {4, FAST, pack, scores, fold, weigh, store};
