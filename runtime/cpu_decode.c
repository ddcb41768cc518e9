/* A decode step's attention on a CPU, every sequence and KV head of the batch in one call (runtime/decode.py
   holds the batch; runtime/cpu_attention.py builds and calls this). Per layer it replaces a dozen torch ops (the
   new rows written, two batched matmuls at a few hundred keys, masks, softmax, conversions), each of which
   cost more in dispatch than in arithmetic at these sizes. GCC's vector extensions: the compiler maps them onto
   the CPU's own vectors (AVX512F, AVX2 and FMA, NEON). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_vec.h"

#if defined(__AVX2__) || defined(__AVX512F__) || defined(__ARM_NEON)
int decode_fast(void) { return 1; }
#else
int decode_fast(void) { return 0; }
#endif

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
