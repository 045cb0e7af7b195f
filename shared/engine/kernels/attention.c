/* Decode attention over the paged KV pool on CPU: one query token per sequence against its
   cached context, for every head, in one call (the torch path takes ~10 small ops a layer).

   pool (num_blocks, 2, block_size, kv_heads, head_dim) fp32, K at index 0 and V at 1 of dim 1;
   q and out (B, heads, head_dim); block_tables (B, width) int64; context_lens (B,) int64.
   Heads that share a KV head (GQA) are read against the same K/V rows. Softmax in fp32 with the
   running maximum subtracted. Threads: OpenMP over (sequence, KV head). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float dot(const float *a, const float *b, int64_t n) {
    float s[8] = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int u = 0; u < 8; u++) s[u] += a[j + u] * b[j + u];
    float sum = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; j < n; j++) sum += a[j] * b[j];
    return sum;
}

/* Returns 0, or -1 when scratch memory is short. */
int paged_decode_attention(const float *q, const float *pool, const int64_t *block_tables,
                           const int64_t *context_lens, int64_t B, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t width, float scale, float *out,
                           int threads) {
    const int64_t group = heads / kv_heads, row = kv_heads * head_dim, block = 2 * block_size * row;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) if (B * kv_heads > 1)
    for (int64_t i = 0; i < B * kv_heads; i++) {
        const int64_t b = i / kv_heads, kh = i % kv_heads, ctx = context_lens[b];
        const int64_t *table = block_tables + b * width;
        float *scores = malloc(sizeof(float) * (size_t)(group * ctx));
        if (!scores) {
            failed = 1;
            continue;
        }
        for (int64_t g = 0; g < group; g++) {
            const int64_t h = kh * group + g;
            const float *qh = q + (b * heads + h) * head_dim;
            float *s = scores + g * ctx, mx = -INFINITY;
            for (int64_t p = 0; p < ctx; p++) {
                const float *k = pool + table[p / block_size] * block + (p % block_size) * row + kh * head_dim;
                s[p] = dot(qh, k, head_dim) * scale;
                mx = fmaxf(mx, s[p]);
            }
            float total = 0.0f;
            for (int64_t p = 0; p < ctx; p++) {
                s[p] = expf(s[p] - mx);
                total += s[p];
            }
            float *o = out + (b * heads + h) * head_dim;
            for (int64_t j = 0; j < head_dim; j++) o[j] = 0.0f;
            for (int64_t p = 0; p < ctx; p++) {
                const float *v = pool + table[p / block_size] * block + block_size * row + (p % block_size) * row
                                 + kh * head_dim;
                const float w = s[p] / total;
                for (int64_t j = 0; j < head_dim; j++) o[j] += w * v[j];
            }
        }
        free(scores);
    }
    return failed ? -1 : 0;
}
