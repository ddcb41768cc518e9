/* Rows of KV written into a sequence's blocks where a layer's table says they lie (runtime/cpu_attention.py calls
   it): a blend's reused KV placed at its new positions with its keys RoPE-shifted there in the same pass, and the
   rows it recomputes scattered to theirs. In torch each was a handful of ops per block and piece (a float32 copy,
   a rotation of halves, two products, a sum, a conversion, the copies), every one a pass over the rows.

   The rotation is runtime/kernels.py's rope_shift, bit for bit: in float32, x cos + rotate_half(x) sin with each
   product rounded to float32 before the sum (no fused multiply-add: contraction is off for this file), then
   rounded to the element type. */

#pragma GCC optimize("fp-contract=off")

#include <stdint.h>
#include <string.h>

#include "cpu_vec.h"

#define BLOCK_ROWS 64 /* runtime/kv.py's BLOCK: cpu_attention.py checks it against cpu_block.h's */

static inline void shift_row(int bf16, const void *x, const float *c, const float *s, void *out, int d) {
    int half = d / 2, e = 0;
    if (half % LANES == 0)
        for (; e < d; e += LANES) {
            int lower = e < half;
            vf turned = get(x, lower ? e + half : e - half, bf16);
            vf a = get(x, e, bf16) * load(c + e), b = turned * load(s + e);
            set(out, e, lower ? a - b : a + b, bf16);
        }
    for (; e < d; e++) {
        float turned = e < half ? -element(x, e + half, bf16) : element(x, e - half, bf16);
        put(out, e, element(x, e, bf16) * c[e] + turned * s[e], bf16);
    }
}

/* Rows i = 0..n-1 of k and v ([kv_heads, n, d]: heads `khead`/`vhead` elements apart, rows `krow`/`vrow`, the
   last dimension dense) written at position `positions[i]` (NULL: start + i) of the blocks in `table` ([4][columns],
   runtime/kv.py `KVCache.table`: per block its K and V addresses at KV head 0 and the elements between two heads).
   `cos`, `sin` (float32 [n, d], dense; NULL: none) rotate the keys as they are written. `elem`: 2 (bf16) or 4
   (float32). */
int write_rows(int elem, const void *k, int64_t khead, int64_t krow, const void *v, int64_t vhead, int64_t vrow,
               const float *cos, const float *sin, const int64_t *table, int64_t columns, const int64_t *positions,
               int n, int start, int kv_heads, int d, int threads) {
    int bf16 = elem == 2;
    const char *kc = k, *vc = v;
#pragma omp parallel for schedule(static) num_threads(threads) if ((int64_t)n * kv_heads * d >= (1 << 16))
    for (int64_t it = 0; it < (int64_t)n * kv_heads; it++) {
        int h = (int)(it / n), i = (int)(it % n);
        int64_t at = positions != NULL ? positions[i] : start + i, b = at / BLOCK_ROWS, row = at % BLOCK_ROWS;
        char *kd = (char *)table[b] + (h * table[2 * columns + b] + row * d) * elem;
        char *vd = (char *)table[columns + b] + (h * table[3 * columns + b] + row * d) * elem;
        const char *ks = kc + (h * khead + i * krow) * elem, *vs = vc + (h * vhead + i * vrow) * elem;
        if (cos != NULL)
            shift_row(bf16, ks, cos + (int64_t)i * d, sin + (int64_t)i * d, kd, d);
        else
            memcpy(kd, ks, (size_t)d * elem);
        memcpy(vd, vs, (size_t)d * elem);
    }
    return 0;
}
