/* A decode pass's decoder layers in one call (PD_WEIGHTS=native on CPU, fused.py): for each
   layer, the same steps in the same order as the model's per-layer path (model.py), so the
   result is the same to the bit —

     qkv = rmsnorm(x) @ Wqkv.T                  (blocks.c, the norm as the product's prologue)
     RoPE on q and k, K/V into the layer's pool, attention over each sequence's blocks (attention.c)
     h   = x + attn @ Wo.T
     gu  = rmsnorm(h) @ Wgate_up.T
     x   = h + (silu(gate)·up) @ Wdown.T

   — by one team of threads for the whole pass (one fork and join, not one a product), with no
   Python between the steps. Every matrix is a GGUF file's Q4_1 or Q8_0 blocks. */

#include "attention.c"
#include "blocks.c"

enum { QKV, O, GATE_UP, DOWN, IN_NORM, POST_NORM, POINTERS };

/* x (B, hidden): the residual stream, in and out. weights (layers, POINTERS): the addresses of
   each layer's four matrices' blocks and its two norms' weights (hidden floats); kinds (layers,
   4): each matrix's format (Q4_1 0, Q8_0 1). pools: layer l's pool at pools + l·layer_stride
   floats, laid out as attention.c's. cos, sin, rows, block_tables, context_lens as
   decode_attention's. Returns 0, -1 when scratch memory is short, -2 for a head_dim over 256 or
   widths not multiples of 32. */
int decode_layers(float *x, int64_t layers, const int64_t *weights, const int32_t *kinds, int64_t hidden,
                  int64_t intermediate, float eps, const float *cos, const float *sin, float *pools,
                  int64_t layer_stride, const int64_t *rows, const int64_t *block_tables,
                  const int64_t *context_lens, int64_t B, int64_t heads, int64_t kv_heads, int64_t head_dim,
                  int64_t block_size, int64_t width, float scale, int threads) {
    const int64_t n_qkv = (heads + 2 * kv_heads) * head_dim, n_attn = heads * head_dim;
    if (head_dim > 256 || hidden % QK || intermediate % QK || n_attn % QK) return -2;
    const int64_t k_max = intermediate > n_attn ? (intermediate > hidden ? intermediate : hidden)
                                                : (n_attn > hidden ? n_attn : hidden);
    float *qkv = malloc(sizeof(float) * (size_t)(B * n_qkv)), *q = malloc(sizeof(float) * (size_t)(B * n_attn));
    float *attn = malloc(sizeof(float) * (size_t)(B * n_attn)), *h = malloc(sizeof(float) * (size_t)(B * hidden));
    float *gu = malloc(sizeof(float) * (size_t)(B * 2 * intermediate));
    struct scratch s;
    int failed = scratch_alloc(&s, B, k_max) != 0 || !qkv || !q || !attn || !h || !gu;
    if (!failed) {
#pragma omp parallel num_threads(threads)
        for (int64_t l = 0; l < layers; l++) {
            const int64_t *w = weights + l * POINTERS;
            const int32_t *kind = kinds + l * 4;
            float *pool = pools + l * layer_stride;
            const struct prologue in_norm = {(const float *)w[IN_NORM], eps, 0};
            const struct prologue post_norm = {(const float *)w[POST_NORM], eps, 0};
            const struct prologue plain = {NULL, 0.0f, 0}, swiglu = {NULL, 0.0f, 1};
            team_matmul(kind[QKV], x, B, hidden, (const uint8_t *)w[QKV], n_qkv, qkv, NULL, in_norm, s);
            team_rope_write(qkv, cos, sin, pool, rows, B, heads, kv_heads, head_dim, block_size, q);
            team_attend(q, pool, block_tables, context_lens, B, heads, kv_heads, head_dim, block_size, width, scale,
                        attn, &failed);
            team_matmul(kind[O], attn, B, n_attn, (const uint8_t *)w[O], hidden, h, x, plain, s);
            team_matmul(kind[GATE_UP], h, B, hidden, (const uint8_t *)w[GATE_UP], 2 * intermediate, gu, NULL,
                        post_norm, s);
            team_matmul(kind[DOWN], gu, B, intermediate, (const uint8_t *)w[DOWN], hidden, x, h, swiglu, s);
        }
    }
    scratch_free(&s);
    free(qkv); free(q); free(attn); free(h); free(gu);
    return failed ? -1 : 0;
}
