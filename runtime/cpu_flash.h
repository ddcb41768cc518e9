/* What runtime/cpu_attention.c's flash driver asks of an element type (cpu_attention_bf16.c, cpu_attention_f32.c).

   A kind packs a block of BLOCK keys and values, scores rows of queries against a packed block, turns a row's
   scores into its softmax weights (the online step), adds weighted values into float32 sums and stores a row.
   Each computes a row by the same operations in the same order whatever rows share its call (a tile of rows and
   a row alone run the same sequence of fused multiply-adds), which is what keeps a prefill split anywhere equal
   to the whole. Packed blocks take BLOCK * d elements, a row of weights BLOCK elements, a row of queries d. */

#ifndef KVGATE_CPU_FLASH_H
#define KVGATE_CPU_FLASH_H

#include <math.h>
#include <stdint.h>

#include "cpu_block.h" /* BLOCK: keys a block, positions b*BLOCK .. b*BLOCK+63 */
#define QROWS 32 /* query positions an item */

struct kind {
    int elem;  /* bytes an element of q, k, v and out */
    int fast;  /* built for this CPU's own vector instructions */
    /* keys and values of rows b*BLOCK.. of k, v (rows `row` elements apart, the first `total` real) into kp, vp */
    void (*pack)(const void *k, const void *v, int64_t row, int total, int d, int b, void *kp, void *vp);
    /* s[r][0..63] = q_r . k_j for rows r0..r1 of q (d elements apart) */
    void (*scores)(const void *q, int r0, int r1, const void *kp, int d, float *s);
    /* a row's scores s (the first `valid` visible) into its weights w; returns the factor for its earlier sums */
    float (*fold)(float *s, int valid, float scale, float *m, float *l, void *w);
    /* o[r][e] += sum_j w_r[j] v_j[e] for rows r0..r1 */
    void (*weigh)(const void *w, int r0, int r1, const void *vp, int d, float *o);
    /* dst[e] = o[e] / l */
    void (*store)(const float *o, float l, int d, void *dst);
};

extern const struct kind BF16, F32;

#ifdef __AVX512F__
#include <immintrin.h>

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

/* The online softmax step of a row over a block, in vector code: x becomes its weights (zero past `valid`). */
static inline float softmax_step(const float *s, int valid, float scale, float *m, float *l, __m512 x[4]) {
    __mmask64 live = valid >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << valid) - 1);
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int c = 0; c < 4; c++) {
        x[c] = _mm512_mul_ps(_mm512_loadu_ps(s + 16 * c), _mm512_set1_ps(scale));
        top = _mm512_mask_max_ps(top, (__mmask16)(live >> (16 * c)), top, x[c]);
    }
    float high = fmaxf(*m, _mm512_reduce_max_ps(top));
    float alpha = *m == -INFINITY ? 0.0f : *m == high ? 1.0f : expf(*m - high);
    __m512 sum = _mm512_setzero_ps();
    for (int c = 0; c < 4; c++) {
        x[c] = _mm512_maskz_mov_ps((__mmask16)(live >> (16 * c)), exp_neg(_mm512_sub_ps(x[c], _mm512_set1_ps(high))));
        sum = _mm512_add_ps(sum, x[c]);
    }
    *l = *l * alpha + _mm512_reduce_add_ps(sum);
    *m = high;
    return alpha;
}
#endif

/* The same step in plain C, in place: s becomes the row's weights (zero past `valid`). */
static inline float softmax_plain(float *s, int valid, float scale, float *m, float *l) {
    float high = *m, sum = 0.0f;
    for (int j = 0; j < valid; j++) high = fmaxf(high, s[j] * scale);
    float alpha = *m == -INFINITY ? 0.0f : *m == high ? 1.0f : expf(*m - high);
    for (int j = 0; j < BLOCK; j++) {
        s[j] = j < valid ? expf(s[j] * scale - high) : 0.0f;
        sum += s[j];
    }
    *l = *l * alpha + sum;
    *m = high;
    return alpha;
}

#endif
