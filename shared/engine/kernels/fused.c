/* A decode pass's decoder layers in one call (PD_WEIGHTS=native on CPU, fused.py): for each
   layer, the same steps in the same order as the model's per-layer path (model.py), so the
   result is the same to the bit —

     qkv = rmsnorm(x) @ Wqkv.T                  (blocks.c, the norm as the product's prologue)
     RoPE on q and k, K/V into the layer's pool, attention over each sequence's blocks (attention.c)
     h   = x + attn @ Wo.T
     gu  = rmsnorm(h) @ Wgate_up.T
     x   = h + (silu(gate)·up) @ Wdown.T

   — by one team of threads for the whole pass (one fork and join, not one a product), with no
   Python between the steps. Every matrix is a GGUF file's blocks (blocks.c's formats). */

#include "attention.c"
#include "blocks.c"

enum { QKV, O, GATE_UP, DOWN };

/* A layer's weights as the caller passes them (int64 each): its four matrices and the
   addresses of its two norms' weights (hidden floats). */
struct layer {
    struct matrix m[4];
    int64_t in_norm, post_norm;
};

/* x (B, hidden): the residual stream, in and out. weights: one `struct layer` a layer. pools:
   layer l's pool at pools + l·layer_stride floats, laid out as attention.c's. cos, sin, rows,
   block_tables, context_lens as decode_attention's. Returns 0, -1 when scratch memory is short,
   -2 for a head_dim over 256 or widths not whole blocks of a matrix's formats. */
int decode_layers(float *x, int64_t layers, const struct layer *weights, int64_t hidden,
                  int64_t intermediate, float eps, const float *cos, const float *sin, float *pools,
                  int64_t layer_stride, const int64_t *rows, const int64_t *block_tables,
                  const int64_t *context_lens, int64_t B, int64_t heads, int64_t kv_heads, int64_t head_dim,
                  int64_t block_size, int64_t width, float scale, int threads) {
    const int64_t n_qkv = (heads + 2 * kv_heads) * head_dim, n_attn = heads * head_dim;
    if (head_dim > 256) return -2;
    for (int64_t l = 0; l < layers; l++) {
        const struct matrix *m = weights[l].m;
        if (!matrix_valid(&m[QKV], hidden) || !matrix_valid(&m[O], n_attn) || !matrix_valid(&m[GATE_UP], hidden)
            || !matrix_valid(&m[DOWN], intermediate))
            return -2;
    }
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
            const struct matrix *w = weights[l].m;
            float *pool = pools + l * layer_stride;
            const struct prologue in_norm = {(const float *)weights[l].in_norm, eps, 0};
            const struct prologue post_norm = {(const float *)weights[l].post_norm, eps, 0};
            const struct prologue plain = {NULL, 0.0f, 0}, swiglu = {NULL, 0.0f, 1};
            team_matmul(&w[QKV], x, B, hidden, qkv, NULL, in_norm, s);
            team_rope_write(qkv, cos, sin, pool, rows, B, heads, kv_heads, head_dim, block_size, q);
            team_attend(q, pool, block_tables, context_lens, B, heads, kv_heads, head_dim, block_size, width, scale,
                        attn, &failed);
            team_matmul(&w[O], attn, B, n_attn, h, x, plain, s);
            team_matmul(&w[GATE_UP], h, B, hidden, gu, NULL, post_norm, s);
            team_matmul(&w[DOWN], gu, B, intermediate, x, h, swiglu, s);
        }
    }
    scratch_free(&s);
    free(qkv); free(q); free(attn); free(h); free(gu);
    return failed ? -1 : 0;
}
