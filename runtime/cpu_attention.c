/* Causal attention of a prompt's rows over bf16 KV on a CPU (runtime/cpu_attention.py builds and calls it).

   Flash attention: each (KV head, block of query positions) reads its keys in blocks of BLOCK at absolute
   positions (0, 64, 128, ...) with an online softmax, the query heads of a GQA group side by side. Every row
   is computed by the same operations in the same order whatever rows share its call: which other rows, where
   the call begins, how many threads run it. So a prompt's attention is the same bit for bit however its
   prefill is split (the engine's `exact` reuse rests on that), and no grid of calls is needed to keep it so.

   Dots and weighted sums of bf16 pairs accumulate in float32 (AVX512-BF16's vdpbf16ps where the compiler
   targets it, the same arithmetic written out in C elsewhere: a check of the method, not a fast path).
   Softmax weights are rounded to bf16 before the weighted sum of values, as the GEMM-based kernels do. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_bf16.h"

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#define FAST 1
#else
#define FAST 0
#endif

#define BLOCK 64   /* keys a block: positions b*BLOCK .. b*BLOCK+63 */
#define QROWS 32   /* query positions an item */

int fast(void) { return FAST; }

/* Keys of head h, block b, as pairs: kp[p * BLOCK + j] = (K[j][2p], K[j][2p+1]); values as vp[jp * d + e] =
   (V[2jp][e], V[2jp+1][e]). Rows past `total` are zeros. */
static void pack(const bf16 *k, const bf16 *v, int64_t row, int total, int d, int b, uint32_t *kp, uint32_t *vp) {
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
static inline __m512 exp_neg(__m512 x) { /* e^x for x <= 0; ~1 ulp */
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), 0x08);
    __m512 f = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    f = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), f);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* s[r][0..63] = q_r . k_j for rows r0..r1 of q (dwords: bf16 pairs, `qrow` dwords apart). */
static void scores(const uint32_t *q, int64_t qrow, int r0, int r1, const uint32_t *kp, int d, float *s) {
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
static void weigh(const uint32_t *w, int r0, int r1, const uint32_t *vp, int d, float *o) {
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
static float fold(float *s, int valid, float scale, float *m, float *l, uint32_t *w) {
    __mmask64 live = valid >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << valid) - 1);
    __m512 x[4], top = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < 4; c++) {
        x[c] = _mm512_mul_ps(_mm512_loadu_ps(s + 16 * c), _mm512_set1_ps(scale));
        top = _mm512_mask_max_ps(top, (__mmask16)(live >> (16 * c)), top, x[c]);
    }
    float high = fmaxf(*m, _mm512_reduce_max_ps(top));
    float alpha = *m == -INFINITY ? 0.0f : expf(*m - high);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < 4; c++) {
        x[c] = _mm512_maskz_mov_ps((__mmask16)(live >> (16 * c)), exp_neg(_mm512_sub_ps(x[c], _mm512_set1_ps(high))));
        sum = _mm512_add_ps(sum, x[c]);
    }
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    *m = high;
    _mm512_storeu_si512(w, (__m512i)_mm512_cvtne2ps_pbh(x[1], x[0]));
    _mm512_storeu_si512(w + 16, (__m512i)_mm512_cvtne2ps_pbh(x[3], x[2]));
    return alpha;
}

#else /* the same method in plain C */

static void scores(const uint32_t *q, int64_t qrow, int r0, int r1, const uint32_t *kp, int d, float *s) {
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

static void weigh(const uint32_t *w, int r0, int r1, const uint32_t *vp, int d, float *o) {
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

static float fold(float *s, int valid, float scale, float *m, float *l, uint32_t *w) {
    float high = *m;
    for (int j = 0; j < valid; j++) high = fmaxf(high, s[j] * scale);
    float alpha = *m == -INFINITY ? 0.0f : expf(*m - high), sum = 0.0f;
    bf16 *wh = (bf16 *)w;
    for (int j = 0; j < BLOCK; j++) {
        float p = j < valid ? expf(s[j] * scale - high) : 0.0f;
        sum += p;
        wh[j] = to_bf16(p);
    }
    *l = *l * alpha + sum;
    *m = high;
    return alpha;
}
#endif

/* q [heads, n, d] (rows `qrow` elements apart, heads `qhead`), k and v [kv_heads, >= start + n, d] (rows d
   apart, heads `kvhead`), out [heads, n, d] contiguous: row i of q is at position start + i and sees keys
   0..start + i. d a multiple of 64, heads a multiple of kv_heads. Returns 0, or -1 when out of memory. */
int attend(const bf16 *q, int64_t qhead, int64_t qrow, const bf16 *k, const bf16 *v, int64_t kvhead, bf16 *out,
           int heads, int kv_heads, int n, int start, int d, float scale, int threads) {
    int total = start + n, blocks = (total + BLOCK - 1) / BLOCK, group = heads / kv_heads;
    int qblocks = (n + QROWS - 1) / QROWS, items = kv_heads * qblocks;
    int64_t packed = (int64_t)BLOCK * d / 2; /* dwords a packed block of K (and of V) */
    uint32_t *kp = malloc(sizeof(uint32_t) * packed * blocks * kv_heads);
    uint32_t *vp = malloc(sizeof(uint32_t) * packed * blocks * kv_heads);
    int failed = kp == NULL || vp == NULL;
    if (!failed) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int i = 0; i < kv_heads * blocks; i++) {
            int h = i / blocks, b = i % blocks;
            pack(k + h * kvhead, v + h * kvhead, d, total, d, b, kp + packed * i, vp + packed * i);
        }
#pragma omp parallel num_threads(threads)
        {
            int rows = QROWS * group;
            float *s = malloc(sizeof(float) * rows * BLOCK), *o = malloc(sizeof(float) * rows * d);
            float *m = malloc(sizeof(float) * rows), *l = malloc(sizeof(float) * rows);
            uint32_t *w = malloc(sizeof(uint32_t) * rows * BLOCK / 2);
            uint32_t *qs = malloc(sizeof(uint32_t) * rows * d / 2);
            if (s == NULL || o == NULL || m == NULL || l == NULL || w == NULL || qs == NULL) {
#pragma omp atomic write
                failed = 1;
            }
#pragma omp for schedule(dynamic, 1)
            for (int it = 0; it < items; it++) {
                if (failed) continue;
                int h = it % kv_heads, qb = qblocks - 1 - it / kv_heads; /* the longest rows first */
                int p0 = qb * QROWS, np = n - p0 < QROWS ? n - p0 : QROWS, nr = np * group;
                for (int pi = 0; pi < np; pi++) /* row r = position pi, head h * group + g */
                    for (int g = 0; g < group; g++)
                        memcpy(qs + (pi * group + g) * d / 2, q + (h * group + g) * qhead + (p0 + pi) * qrow,
                               sizeof(bf16) * d);
                for (int r = 0; r < nr; r++) m[r] = -INFINITY, l[r] = 0.0f;
                memset(o, 0, sizeof(float) * nr * d);
                int last = (start + p0 + np - 1) / BLOCK;
                for (int b = 0; b <= last; b++) {
                    int first = b * BLOCK - start - p0; /* the first of the item's positions that sees block b */
                    int r0 = first > 0 ? first * group : 0;
                    const uint32_t *kb = kp + packed * (h * blocks + b), *vb = vp + packed * (h * blocks + b);
                    scores(qs, d / 2, r0, nr, kb, d, s);
                    for (int r = r0; r < nr; r++) {
                        int valid = start + p0 + r / group - b * BLOCK + 1;
                        float alpha = fold(s + r * BLOCK, valid < BLOCK ? valid : BLOCK, scale, m + r, l + r,
                                           w + r * BLOCK / 2);
                        for (int e = 0; e < d; e++) o[r * d + e] *= alpha;
                    }
                    weigh(w, r0, nr, vb, d, o);
                }
                for (int r = 0; r < nr; r++) {
                    int pi = r / group, g = r % group;
                    bf16 *dst = out + ((int64_t)(h * group + g) * n + p0 + pi) * d;
                    for (int e = 0; e < d; e++) dst[e] = to_bf16(o[r * d + e] / l[r]);
                }
            }
            free(s), free(o), free(m), free(l), free(w), free(qs);
        }
    }
    free(kp), free(vp);
    return failed ? -1 : 0;
}
