/* Decode attention over the paged KV pool on CPU: one query token per sequence against its
   cached context, for every head, in one call (torch's path takes ~10 small ops a layer).

   pool (num_blocks, 2, block_size, kv_heads, head_dim) fp32, K at index 0 and V at 1 of dim 1;
   q and out (B, heads, head_dim); block_tables (B, width) int64; context_lens (B,) int64.
   Heads that share a KV head (GQA) are read against the same K/V rows. A sliding window (the
   query at position p sees p - window < j <= p; 0: the whole context) and soft-capped scores
   (cap·tanh(s / cap); 0: uncapped) where the layer has them. Softmax in fp32 with the running
   maximum subtracted. Threads: OpenMP over (sequence, head). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float dot(const float *a, const float *b, int64_t n) {
    float s[8] = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        for (int u = 0; u < 8; u++) s[u] += a[j + u] * b[j + u];
    float sum = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    for (; j < n; j++) sum += a[j] * b[j];
    return sum;
}

/* By the threads of the enclosing parallel region, each calling it (work-sharing over
   (sequence, head); outside a region one thread does it all); sets *failed when scratch memory
   is short. Positions are walked block by block (no division a position), from the window's
   first block. */
static void team_attend(const float *q, const float *pool, const int64_t *block_tables, const int64_t *context_lens,
                        int64_t B, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                        int64_t width, float scale, int64_t window, float softcap, float *out, int *failed) {
    const int64_t group = heads / kv_heads, row = kv_heads * head_dim, block = 2 * block_size * row;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < B * heads; i++) {
        const int64_t b = i / heads, h = i % heads, kh = h / group, ctx = context_lens[b];
        const int64_t *table = block_tables + b * width;
        const int64_t first = window && ctx > window ? ctx - window : 0, len = ctx - first;
        const int64_t blk0 = first / block_size;
        const float *qh = q + i * head_dim;
        float *scores = malloc(sizeof(float) * (size_t)len);
        if (!scores) {
#pragma omp atomic write
            *failed = 1;
            continue;
        }
        float mx = -INFINITY;
        for (int64_t start = blk0 * block_size, blk = blk0; start < ctx; start += block_size, blk++) {
            const float *k = pool + table[blk] * block + kh * head_dim;
            const int64_t n = ctx - start < block_size ? ctx - start : block_size;
            for (int64_t o = start < first ? first - start : 0; o < n; o++) {
                float sc = dot(qh, k + o * row, head_dim) * scale;
                if (softcap != 0.0f) sc = tanhf(sc / softcap) * softcap;
                scores[start + o - first] = sc;
                mx = fmaxf(mx, sc);
            }
        }
        float total = 0.0f;
        for (int64_t p = 0; p < len; p++) {
            scores[p] = expf(scores[p] - mx);
            total += scores[p];
        }
        float acc[256] = {0};  /* head_dim <= 256 (checked by the caller) */
        for (int64_t start = blk0 * block_size, blk = blk0; start < ctx; start += block_size, blk++) {
            const float *v = pool + table[blk] * block + block_size * row + kh * head_dim;
            const int64_t n = ctx - start < block_size ? ctx - start : block_size;
            for (int64_t o = start < first ? first - start : 0; o < n; o++) {
                const float w = scores[start + o - first];
                const float *vo = v + o * row;
                for (int64_t j = 0; j < head_dim; j++) acc[j] += w * vo[j];
            }
        }
        float *oh = out + i * head_dim;
        for (int64_t j = 0; j < head_dim; j++) oh[j] = acc[j] / total;
        free(scores);
    }
}

static int attend(const float *q, const float *pool, const int64_t *block_tables, const int64_t *context_lens,
                  int64_t B, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t width,
                  float scale, int64_t window, float softcap, float *out, int threads) {
    int failed = 0;
#pragma omp parallel num_threads(threads) if (B * heads > 1)
    team_attend(q, pool, block_tables, context_lens, B, heads, kv_heads, head_dim, block_size, width, scale, window,
                softcap, out, &failed);
    return failed ? -1 : 0;
}

int paged_decode_attention(const float *q, const float *pool, const int64_t *block_tables,
                           const int64_t *context_lens, int64_t B, int64_t heads, int64_t kv_heads,
                           int64_t head_dim, int64_t block_size, int64_t width, float scale, int64_t window,
                           float softcap, float *out, int threads) {
    if (head_dim > 256) return -2;
    return attend(q, pool, block_tables, context_lens, B, heads, kv_heads, head_dim, block_size, width, scale, window,
                  softcap, out, threads);
}

/* RoPE on the q and k heads of each token's qkv row (rotate-half: x·cos + (x2, x1)·sin, sin
   with its first half negated, cos and sin (B, head_dim) at each token's position; in place),
   q copied out to q (B, heads·head_dim), the new K and V written at `rows` (B,) of the pool (key
   rows; values block_size rows further, as torch_ref.kv_rows). Work-sharing over tokens. */
static void team_rope_write(float *qkv, const float *cos, const float *sin, float *pool, const int64_t *rows,
                            int64_t B, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t block_size,
                            float *q) {
    const int64_t width_qkv = (heads + 2 * kv_heads) * head_dim, half = head_dim / 2, row = kv_heads * head_dim;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++) {
        float *t = qkv + b * width_qkv;
        const float *c = cos + b * head_dim, *s = sin + b * head_dim;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float *x = t + h * head_dim;
            for (int64_t j = 0; j < half; j++) {
                const float x1 = x[j], x2 = x[j + half];
                x[j] = x1 * c[j] + x2 * s[j];
                x[j + half] = x2 * c[j + half] + x1 * s[j + half];
            }
        }
        memcpy(q + b * heads * head_dim, t, sizeof(float) * (size_t)(heads * head_dim));
        memcpy(pool + rows[b] * row, t + heads * head_dim, sizeof(float) * (size_t)row);
        memcpy(pool + (rows[b] + block_size) * row, t + (heads + kv_heads) * head_dim, sizeof(float) * (size_t)row);
    }
}

/* The decode step's whole attention after the qkv product: qkv (B, (heads + 2·kv_heads)·head_dim)
   as the product gives it, rotated and its K/V written (team_rope_write), then attention as
   above into out (B, heads·head_dim). */
int decode_attention(float *qkv, const float *cos, const float *sin, float *pool, const int64_t *rows,
                     const int64_t *block_tables, const int64_t *context_lens, int64_t B, int64_t heads,
                     int64_t kv_heads, int64_t head_dim, int64_t block_size, int64_t width, float scale, float *out,
                     int threads) {
    if (head_dim > 256) return -2;
    float *q = malloc(sizeof(float) * (size_t)(B * heads * head_dim));
    if (!q) return -1;
    team_rope_write(qkv, cos, sin, pool, rows, B, heads, kv_heads, head_dim, block_size, q);
    const int rc = attend(q, pool, block_tables, context_lens, B, heads, kv_heads, head_dim, block_size, width, scale,
                          0, 0.0f, out, threads);
    free(q);
    return rc;
}
