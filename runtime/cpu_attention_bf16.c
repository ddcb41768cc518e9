/* The bf16 kind of runtime/cpu_attention.c: dots and weighted sums of bf16 pairs accumulate in float32
   (AVX512-BF16's vdpbf16ps where the compiler targets it, the same arithmetic written out in C elsewhere: a check
   of the method, not a fast path). Softmax weights are rounded to bf16 before the weighted sum of values, as the
   GEMM-based kernels do. */

#include <stdint.h>

#include "cpu_bf16.h"
#include "cpu_flash.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define FAST 1
#else
#define FAST 0
#endif

/* Keys of head h, block b, as pairs: kp[p * BLOCK + j] = (K[j][2p], K[j][2p+1]); values as vp[jp * d + e] =
   (V[2jp][e], V[2jp+1][e]). Rows past `total` are zeros. */
static void pack(const void *kk, const void *vv, int64_t row, int total, int d, int b, void *kpp, void *vpp) {
    const bf16 *k = kk, *v = vv;
    uint32_t *kp = kpp, *vp = vpp;
    for (int j = 0; j < BLOCK; j++) {
        int t = b * BLOCK + j;
        const bf16 *kr = k + (int64_t)t * row;
        for (int p = 0; p < d / 2; p++)
            kp[p * BLOCK + j] = t < total ? (uint32_t)kr[2 * p] | ((uint32_t)kr[2 * p + 1] << 16) : 0;
    }
    for (int jp = 0; jp < BLOCK / 2; jp++) {
        int t = b * BLOCK + 2 * jp;
        for (int e = 0; e < d; e++) {
            uint32_t lo = t < total ? v[(int64_t)t * row + e] : 0;
            uint32_t hi = t + 1 < total ? v[(int64_t)(t + 1) * row + e] : 0;
            vp[jp * d + e] = lo | (hi << 16);
        }
    }
}

#if FAST
/* s[r][0..63] = q_r . k_j for rows r0..r1 of q (dwords: bf16 pairs, `qrow` dwords apart). */
static void scores(const void *qq, int r0, int r1, const void *kpp, int d, float *s) {
    const uint32_t *q = qq, *kp = kpp;
    const int qrow = d / 2;
    int r = r0;
    for (; r + 4 <= r1; r += 4) {
        __m512 a[4][4];
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < 4; c++) a[i][c] = _mm512_setzero_ps();
        for (int p = 0; p < d / 2; p++) {
            __m512bh k0 = (__m512bh)_mm512_loadu_si512(kp + p * BLOCK);
            __m512bh k1 = (__m512bh)_mm512_loadu_si512(kp + p * BLOCK + 16);
            __m512bh k2 = (__m512bh)_mm512_loadu_si512(kp + p * BLOCK + 32);
            __m512bh k3 = (__m512bh)_mm512_loadu_si512(kp + p * BLOCK + 48);
            for (int i = 0; i < 4; i++) {
                __m512bh x = (__m512bh)_mm512_set1_epi32((int)q[(r + i) * qrow + p]);
                a[i][0] = _mm512_dpbf16_ps(a[i][0], x, k0);
                a[i][1] = _mm512_dpbf16_ps(a[i][1], x, k1);
                a[i][2] = _mm512_dpbf16_ps(a[i][2], x, k2);
                a[i][3] = _mm512_dpbf16_ps(a[i][3], x, k3);
            }
        }
        for (int i = 0; i < 4; i++)
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + (r + i) * BLOCK + 16 * c, a[i][c]);
    }
    for (; r < r1; r++) {
        __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int p = 0; p < d / 2; p++) {
            __m512bh x = (__m512bh)_mm512_set1_epi32((int)q[r * qrow + p]);
            for (int c = 0; c < 4; c++)
                a[c] = _mm512_dpbf16_ps(a[c], x, (__m512bh)_mm512_loadu_si512(kp + p * BLOCK + 16 * c));
        }
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(s + r * BLOCK + 16 * c, a[c]);
    }
}

/* o[r][e] += sum_j w_r[j] v_j[e] for rows r0..r1, w as bf16 pairs (BLOCK / 2 dwords a row). */
static void weigh(const void *ww, int r0, int r1, const void *vpp, int d, float *o) {
    const uint32_t *w = ww, *vp = vpp;
    for (int e0 = 0; e0 < d; e0 += 64) {
        int r = r0;
        for (; r + 4 <= r1; r += 4) {
            __m512 a[4][4];
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < 4; c++) a[i][c] = _mm512_loadu_ps(o + (r + i) * d + e0 + 16 * c);
            for (int jp = 0; jp < BLOCK / 2; jp++) {
                const uint32_t *vr = vp + jp * d + e0;
                __m512bh v0 = (__m512bh)_mm512_loadu_si512(vr);
                __m512bh v1 = (__m512bh)_mm512_loadu_si512(vr + 16);
                __m512bh v2 = (__m512bh)_mm512_loadu_si512(vr + 32);
                __m512bh v3 = (__m512bh)_mm512_loadu_si512(vr + 48);
                for (int i = 0; i < 4; i++) {
                    __m512bh x = (__m512bh)_mm512_set1_epi32((int)w[(r + i) * (BLOCK / 2) + jp]);
                    a[i][0] = _mm512_dpbf16_ps(a[i][0], x, v0);
                    a[i][1] = _mm512_dpbf16_ps(a[i][1], x, v1);
                    a[i][2] = _mm512_dpbf16_ps(a[i][2], x, v2);
                    a[i][3] = _mm512_dpbf16_ps(a[i][3], x, v3);
                }
            }
            for (int i = 0; i < 4; i++)
                for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + (r + i) * d + e0 + 16 * c, a[i][c]);
        }
        for (; r < r1; r++) {
            __m512 a[4];
            for (int c = 0; c < 4; c++) a[c] = _mm512_loadu_ps(o + r * d + e0 + 16 * c);
            for (int jp = 0; jp < BLOCK / 2; jp++) {
                __m512bh x = (__m512bh)_mm512_set1_epi32((int)w[r * (BLOCK / 2) + jp]);
                for (int c = 0; c < 4; c++)
                    a[c] = _mm512_dpbf16_ps(a[c], x, (__m512bh)_mm512_loadu_si512(vp + jp * d + e0 + 16 * c));
            }
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(o + r * d + e0 + 16 * c, a[c]);
        }
    }
}

/* One row's softmax step over a block: s (scores of its 64 keys, the first `valid` visible) becomes its
   weights as bf16 pairs in w; returns the factor its earlier sums are scaled by. */
static float fold(float *s, int valid, float scale, float *m, float *l, void *w) {
    __m512 x[4];
    float alpha = softmax_step(s, valid, scale, m, l, x);
    _mm512_storeu_si512(w, (__m512i)_mm512_cvtne2ps_pbh(x[1], x[0]));
    _mm512_storeu_si512((uint32_t *)w + 16, (__m512i)_mm512_cvtne2ps_pbh(x[3], x[2]));
    return alpha;
}

#else /* the same method in plain C */

static void scores(const void *qq, int r0, int r1, const void *kpp, int d, float *s) {
    const uint32_t *q = qq, *kp = kpp;
    const int qrow = d / 2;
    for (int r = r0; r < r1; r++)
        for (int j = 0; j < BLOCK; j++) {
            float a = 0.0f;
            for (int p = 0; p < d / 2; p++) {
                uint32_t x = q[r * qrow + p], k = kp[p * BLOCK + j];
                a += from_bf16((bf16)(x >> 16)) * from_bf16((bf16)(k >> 16));
                a += from_bf16((bf16)x) * from_bf16((bf16)k);
            }
            s[r * BLOCK + j] = a;
        }
}

static void weigh(const void *ww, int r0, int r1, const void *vpp, int d, float *o) {
    const uint32_t *w = ww, *vp = vpp;
    for (int r = r0; r < r1; r++)
        for (int e = 0; e < d; e++) {
            float a = o[r * d + e];
            for (int jp = 0; jp < BLOCK / 2; jp++) {
                uint32_t x = w[r * (BLOCK / 2) + jp], v = vp[jp * d + e];
                a += from_bf16((bf16)(x >> 16)) * from_bf16((bf16)(v >> 16));
                a += from_bf16((bf16)x) * from_bf16((bf16)v);
            }
            o[r * d + e] = a;
        }
}

static float fold(float *s, int valid, float scale, float *m, float *l, void *w) {
    float alpha = softmax_plain(s, valid, scale, m, l);
    for (int j = 0; j < BLOCK; j++) ((bf16 *)w)[j] = to_bf16(s[j]);
    return alpha;
}
#endif


static void store(const float *o, float l, int d, void *dst) {
    for (int e = 0; e < d; e++) ((bf16 *)dst)[e] = to_bf16(o[e] / l);
}

const struct kind BF16 = {2, FAST, pack, scores, fold, weigh, store};
