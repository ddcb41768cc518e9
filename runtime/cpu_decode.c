/* A decode step's attention on a CPU, every sequence and KV head of the batch in one call, over each sequence's KV
   where it lies: blocks of BLOCK positions in the model's dtype (runtime/kv.py; runtime/decode.py holds the batch,
   runtime/cpu_attention.py builds and calls this). Per layer it replaces a dozen torch ops (the new rows written,
   two batched matmuls at a few hundred keys, masks, softmax, conversions), each of which cost more in dispatch
   than in arithmetic at these sizes, and the copy of the batch's KV they needed. GCC's vector extensions: the
   compiler maps them onto the CPU's own vectors (AVX512F, AVX2 and FMA, NEON). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_block.h"
#include "cpu_vec.h"

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__ARM_NEON)
int decode_fast(void) { return 1; }
#else
int decode_fast(void) { return 0; }
#endif

/* Row p of KV head h, keys (which 0) or values (1), in a sequence's blocks at `layer`: `t` its [2][4][columns]
   table (layer 0's, then what a layer adds). */
static inline char *row_at(const int64_t *t, int64_t columns, int layer, int which, int h, int p, int d, int elem) {
    int blk = p / BLOCK;
    int64_t at = (int64_t)h * t[(2 + which) * columns + blk] + (int64_t)(p % BLOCK) * d;
    return (char *)(t[which * columns + blk] + layer * t[(4 + which) * columns + blk]) + at * elem;
}

/* Each of `group` rows of scores (`room` apart, the first n real) into e^(score - its top); their sums into `sums`. */
static void softmax_rows(float *s, int group, int room, int n, float *sums) {
    for (int g = 0; g < group; g++) {
        float *sg = s + g * room, top = -INFINITY;
        int j = 0;
        vf tops = splat(-INFINITY), all = {};
        for (; j + LANES <= n; j += LANES) {
            vf x = load(sg + j);
            vi more = x > tops;
            tops = (vf)(((vi)x & more) | ((vi)tops & ~more));
        }
        for (int i = 0; i < LANES; i++) top = fmaxf(top, tops[i]);
        for (; j < n; j++) top = fmaxf(top, sg[j]);
        for (j = 0; j + LANES <= n; j += LANES) {
            vf p = exp_neg(load(sg + j) - top);
            save(sg + j, p);
            all = all + p;
        }
        float sum = total(all);
        for (; j < n; j++) sum += sg[j] = expf(sg[j] - top);
        sums[g] = sum;
    }
}

/* One sequence b and KV head h of `decode` (its arguments; `s` room for group x room scores), the element type and
   the vectors a row (`chunks`) constants where it is inlined, so that a row's sums stay in registers. Rows are walked
   block by block, a pointer moving d elements a row; scores LANES rows at a time, summed together (`totals`). */
INLINE void attend_head(int bf16, int chunks, const void *q, int64_t qs, const void *k, int64_t kstride,
                        const void *v, int64_t vstride, const int64_t *t, int64_t columns, int layer, int end, void *out,
                        int heads, int group, int d, float scale, int window, int b, int h, int room, float *s) {
    int first = window > 0 && end - window + 1 > 0 ? end - window + 1 : 0, n = end + 1 - first;
    int64_t elem = bf16 ? 2 : 4, step = d * elem;
    memcpy(row_at(t, columns, layer, 0, h, end, d, elem), (const char *)k + (b * kstride + (int64_t)h * d) * elem, step);
    memcpy(row_at(t, columns, layer, 1, h, end, d, elem), (const char *)v + (b * vstride + (int64_t)h * d) * elem, step);
    vf qv[16][MOST]; /* the group's queries, scaled */
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++) qv[g][c] = get(q, b * qs + (int64_t)(h * group + g) * d + c * LANES, bf16) * scale;
    for (int blk = first / BLOCK, j = 0; blk <= end / BLOCK; blk++) {
        int lo = first > blk * BLOCK ? first : blk * BLOCK, hi = end < (blk + 1) * BLOCK ? end + 1 : (blk + 1) * BLOCK;
        const char *row = row_at(t, columns, layer, 0, h, lo, d, elem);
        int p = lo;
        for (; p + LANES <= hi; p += LANES, j += LANES, row += LANES * step)
            for (int g = 0; g < group; g++) { /* LANES rows' keys, read from L1 for every head but the first */
                vf a[LANES];
                for (int r = 0; r < LANES; r++) {
                    a[r] = qv[g][0] * get(row + r * step, 0, bf16);
                    for (int c = 1; c < chunks; c++) a[r] = a[r] + qv[g][c] * get(row + r * step, c * LANES, bf16);
                }
                save(s + g * room + j, totals(a));
            }
        for (; p < hi; p++, j++, row += step)
            for (int g = 0; g < group; g++) {
                vf a = qv[g][0] * get(row, 0, bf16);
                for (int c = 1; c < chunks; c++) a = a + qv[g][c] * get(row, c * LANES, bf16);
                s[g * room + j] = total(a);
            }
    }
    float sums[16];
    softmax_rows(s, group, room, n, sums);
    vf acc[16][MOST]; /* each head's sums, in registers over a block's rows (re-read from L1 for the next head) */
    for (int g = 0; g < group; g++)
        for (int c = 0; c < chunks; c++) acc[g][c] = (vf){};
    for (int blk = first / BLOCK, j = 0; blk <= end / BLOCK; blk++) {
        int lo = first > blk * BLOCK ? first : blk * BLOCK, hi = end < (blk + 1) * BLOCK ? end + 1 : (blk + 1) * BLOCK;
        for (int g = 0; g < group; g++) {
            vf a[MOST];
            for (int c = 0; c < chunks; c++) a[c] = acc[g][c];
            const char *row = row_at(t, columns, layer, 1, h, lo, d, elem);
            const float *sg = s + g * room + j;
            for (int p = lo; p < hi; p++, sg++, row += step) {
                vf w = splat(*sg);
                for (int c = 0; c < chunks; c++) a[c] = a[c] + w * get(row, c * LANES, bf16);
            }
            for (int c = 0; c < chunks; c++) acc[g][c] = a[c];
        }
        j += hi - lo;
    }
    for (int g = 0; g < group; g++) {
        vf inv = splat(1.0f / sums[g]);
        for (int c = 0; c < chunks; c++) set(out, ((int64_t)b * heads + h * group + g) * d + c * LANES, acc[g][c] * inv, bf16);
    }
}

/* attend_head with its type and width fixed for the common head sizes; others with the width a variable. */
#define ATTEND(BF16, CHUNKS) \
    attend_head(BF16, CHUNKS, q, qs, k, kstride, v, vstride, t, columns, layer, end, out, heads, group, d, scale, window, b, h, room, s)
#define WIDTHS(BF16)                 \
    switch (d / LANES) {             \
    case 1: ATTEND(BF16, 1); break;  \
    case 2: ATTEND(BF16, 2); break;  \
    case 4: ATTEND(BF16, 4); break;  \
    case 8: ATTEND(BF16, 8); break;  \
    default: ATTEND(BF16, d / LANES); \
    }

/* q [batch, heads, d], k and v [batch, kv_heads, d] (the step's new rows; sequences `qs`, `kstride`, `vstride`
   elements apart, heads d apart), out [batch, heads, d] contiguous, and the KV: all float32, or all bf16 where
   `bf16`. Sequence b's KV lies in blocks, its table [2][4][columns] at table + 8 * columns * b (runtime/kv.py
   `KVCache.located`: per block the address of its K and of its V row 0 of KV head 0 at layer 0, and the elements
   between two heads in each; then what a layer adds to each); rows d apart. Writes each new row into its block at
   position ends[b] of `layer` (a block of the sequence's own), then attends over rows 0 .. ends[b] (the last
   `window` of them; 0: all). d a multiple of 16 and at most 256, at most 16 query heads a KV head. Returns 0; -1
   when out of memory. */
int decode(int bf16, const void *q, int64_t qs, const void *k, int64_t kstride, const void *v, int64_t vstride,
           const int64_t *table, int64_t columns, int layer, const int64_t *ends, void *out, int batch, int heads,
           int kv_heads, int d, float scale, int window, int threads) {
    int group = heads / kv_heads, failed = 0, room = 1;
    for (int b = 0; b < batch; b++) room = ends[b] + 1 > room ? (int)ends[b] + 1 : room;
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
            const int64_t *t = table + 8 * columns * b;
            if (bf16) {
                WIDTHS(1)
            } else {
                WIDTHS(0)
            }
        }
        free(s);
    }
    return failed ? -1 : 0;
}
