/* Causal attention of a prompt's rows on a CPU (runtime/cpu_attention.py builds and calls it), over bf16 or
   float32 KV (the kinds: cpu_attention_bf16.c, cpu_attention_f32.c).

   Flash attention: each (KV head, block of query positions) reads its keys in blocks of BLOCK at absolute
   positions (0, 64, 128, ...) with an online softmax, the query heads of a GQA group side by side. Every row
   is computed by the same operations in the same order whatever rows share its call: which other rows, where
   the call begins, how many threads run it. So a prompt's attention is the same bit for bit however its
   prefill is split (the engine's `exact` reuse rests on that), and no grid of calls is needed to keep it so. */

#include <stdlib.h>
#include <string.h>

#include "cpu_flash.h"

static const struct kind *kind_of(int bf16) { return bf16 ? &BF16 : &F32; }

int fast(int bf16) { return kind_of(bf16)->fast; }

int block(void) { return BLOCK; }

/* q [heads, n, d] (rows `qrow` elements apart, heads `qhead`) over keys and values in blocks of BLOCK positions,
   out [heads, n, d] (rows `orow` elements apart, heads `ohead`), all bf16 (`bf16`) or float32: row i of q is at
   position start + i and sees keys 0..start + i. `table` [4][columns] says per block b where its rows lie: the
   address of its K row 0 of KV head 0, of its V row 0, and the elements between two KV heads in K and in V (rows
   d apart within a block). d a multiple of 64, heads a multiple of kv_heads. `positions` (NULL: start + i) says
   each row's position instead, ascending: the rows a blend recomputes, anywhere in the prompt; a row is computed
   the same either way. Returns 0, or -1 when out of memory. */
int attend(int bf16, const void *q, int64_t qhead, int64_t qrow, const int64_t *table, int64_t columns, void *out,
           int64_t ohead, int64_t orow, int heads, int kv_heads, int n, int start, int d, float scale, int threads,
           const int64_t *positions) {
#define AT(i) (positions != NULL ? (int)positions[i] : start + (i))
    const struct kind *kind = kind_of(bf16);
    const int elem = kind->elem;
    const char *qc = q;
    if (n <= 0) return 0;
    int total = AT(n - 1) + 1, blocks = (total + BLOCK - 1) / BLOCK, group = heads / kv_heads;
    int qblocks = (n + QROWS - 1) / QROWS, items = kv_heads * qblocks;
    int64_t packed = (int64_t)BLOCK * d * elem; /* bytes a packed block of K (and of V) */
    char *kp = malloc(packed * blocks * kv_heads), *vp = malloc(packed * blocks * kv_heads);
    int failed = kp == NULL || vp == NULL;
    if (!failed) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
        for (int i = 0; i < kv_heads * blocks; i++) {
            int h = i / blocks, b = i % blocks;
            const char *kb = (const char *)table[b] + h * table[2 * columns + b] * elem;
            const char *vb = (const char *)table[columns + b] + h * table[3 * columns + b] * elem;
            int valid = total - b * BLOCK < BLOCK ? total - b * BLOCK : BLOCK;
            kind->pack(kb, vb, d, valid, d, 0, kp + packed * i, vp + packed * i);
        }
#pragma omp parallel num_threads(threads)
        {
            int rows = QROWS * group;
            float *s = malloc(sizeof(float) * rows * BLOCK), *o = malloc(sizeof(float) * rows * d);
            float *m = malloc(sizeof(float) * rows), *l = malloc(sizeof(float) * rows);
            char *w = malloc((size_t)rows * BLOCK * elem), *qs = malloc((size_t)rows * d * elem);
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
                        memcpy(qs + (int64_t)(pi * group + g) * d * elem,
                               qc + ((h * group + g) * qhead + (p0 + pi) * qrow) * elem, (size_t)d * elem);
                for (int r = 0; r < nr; r++) m[r] = -INFINITY, l[r] = 0.0f;
                memset(o, 0, sizeof(float) * nr * d);
                int last = AT(p0 + np - 1) / BLOCK, first = 0; /* the first of the item's rows that sees block b */
                for (int b = 0; b <= last; b++) {
                    while (AT(p0 + first) < b * BLOCK) first++;
                    int r0 = first * group;
                    const char *kb = kp + packed * (h * blocks + b), *vb = vp + packed * (h * blocks + b);
                    kind->scores(qs, r0, nr, kb, d, s);
                    for (int r = r0; r < nr; r++) {
                        int valid = AT(p0 + r / group) - b * BLOCK + 1;
                        float alpha = kind->fold(s + r * BLOCK, valid < BLOCK ? valid : BLOCK, scale, m + r, l + r,
                                                 w + (int64_t)r * BLOCK * elem);
                        if (alpha != 1.0f)
                            for (int e = 0; e < d; e++) o[r * d + e] *= alpha;
                    }
                    kind->weigh(w, r0, nr, vb, d, o);
                }
                for (int r = 0; r < nr; r++) {
                    int pi = r / group, g = r % group;
                    kind->store(o + r * d, l[r], d, (char *)out + ((h * group + g) * ohead + (p0 + pi) * orow) * elem);
                }
            }
            free(s), free(o), free(m), free(l), free(w), free(qs);
        }
    }
    free(kp), free(vp);
    return failed ? -1 : 0;
#undef AT
}
