/* A decode pass's decoder layers in one call (PD_WEIGHTS=native on CPU, fused.py): for each
   layer, the steps of the model's per-layer path (model.py) in its order —

     qkv = norm(x) @ Wqkv.T                     (blocks.c, the norm as the product's prologue)
     q and k each RMS-normed per head (Qwen3's and Gemma 3's q/k norms, where the layer has them),
     RoPE on q and k (the local tables on a sliding-window layer, where they differ), K/V into the
     layer's pool, attention over each sequence's blocks (attention.c: its window, soft-capping)
     h   = x + attn @ Wo.T                      (Gemma: x + norm(attn @ Wo.T))
     gu  = norm(h) @ Wgate_up.T
     x   = h + (act(gate)·up) @ Wdown.T         (Gemma: h + norm(… @ Wdown.T)); act SiLU or GELU

   — by one team of threads for the whole pass (one fork and join, not one a product), with no
   Python between the steps. Every matrix is a GGUF file's blocks (blocks.c's formats). The
   products, their prologues and attention are the per-layer path's own C, so for Llama's layer
   the result is the same to the bit; the q/k and output norms are torch's on that path. */

#include "attention.c"
#include "blocks.c"

enum { QKV, O, GATE_UP, DOWN };

/* A layer's weights as the caller passes them (int64 each): its four matrices; the addresses of
   its norms' weights (hidden floats; head_dim for q and k; 0 where the layer has none): before
   attention, before the MLP, after attention's and the MLP's products (Gemma's sandwich), on q
   and k; its sliding window (0: the whole context) and whether it takes the local RoPE tables. */
struct layer {
    struct matrix m[4];
    int64_t in_norm, mlp_norm, attn_out_norm, mlp_out_norm, q_norm, k_norm, window, local;
};

/* The model-wide settings of the layer (one float or flag each, the same for every layer). */
struct arch {
    float eps, softcap;
    int plus_one, gate;
};

/* Each token's q and k heads in qkv (B, (heads + 2·kv_heads)·head_dim) RMS-normed in place. */
static void team_head_norms(float *qkv, int64_t B, int64_t heads, int64_t kv_heads, int64_t head_dim,
                            const float *q_norm, const float *k_norm, struct arch a) {
    const int64_t per = heads + kv_heads, width = (heads + 2 * kv_heads) * head_dim;
#pragma omp for schedule(static)
    for (int64_t i = 0; i < B * per; i++) {
        float *x = qkv + i / per * width + i % per * head_dim;
        rms_norm(x, x, i % per < heads ? q_norm : k_norm, head_dim, a.eps, a.plus_one);
    }
}

/* out (B, n) = x + norm(y). */
static void team_norm_add(float *out, const float *x, const float *y, int64_t B, int64_t n, const float *w,
                          struct arch a, float *rows) {
#pragma omp for schedule(static)
    for (int64_t b = 0; b < B; b++) {
        float *r = rows + b * n;
        rms_norm(r, y + b * n, w, n, a.eps, a.plus_one);
        for (int64_t j = 0; j < n; j++) out[b * n + j] = x[b * n + j] + r[j];
    }
}

/* x (B, hidden): the residual stream, in and out. weights: one `struct layer` a layer. cos, sin
   (B, head_dim) at each token's position, the global layers' tables and the local ones' (the
   same pointers where they do not differ). pools: layer l's pool at pools + l·layer_stride
   floats, laid out as attention.c's. rows, block_tables, context_lens as decode_attention's.
   Returns 0, -1 when scratch memory is short, -2 for a head_dim over 256 or widths not whole
   blocks of a matrix's formats. */
int decode_layers(float *x, int64_t layers, const struct layer *weights, int64_t hidden, int64_t intermediate,
                  struct arch a, const float *cos, const float *sin, const float *local_cos, const float *local_sin,
                  float *pools, int64_t layer_stride, const int64_t *rows, const int64_t *block_tables,
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
    float *y = malloc(sizeof(float) * (size_t)(B * hidden)), *normed = malloc(sizeof(float) * (size_t)(B * hidden));
    struct scratch s;
    int failed = scratch_alloc(&s, B, k_max) != 0 || !qkv || !q || !attn || !h || !gu || !y || !normed;
    if (!failed) {
#pragma omp parallel num_threads(threads)
        for (int64_t l = 0; l < layers; l++) {
            const struct layer *L = &weights[l];
            const struct matrix *w = L->m;
            float *pool = pools + l * layer_stride;
            const struct prologue in_norm = {(const float *)L->in_norm, a.eps, NO_GATE, a.plus_one};
            const struct prologue mlp_norm = {(const float *)L->mlp_norm, a.eps, NO_GATE, a.plus_one};
            const struct prologue plain = {NULL, 0.0f, NO_GATE, 0}, gate = {NULL, 0.0f, a.gate, 0};
            team_matmul(&w[QKV], x, B, hidden, qkv, NULL, in_norm, s);
            if (L->q_norm)
                team_head_norms(qkv, B, heads, kv_heads, head_dim, (const float *)L->q_norm, (const float *)L->k_norm, a);
            team_rope_write(qkv, L->local ? local_cos : cos, L->local ? local_sin : sin, pool, rows, B, heads, kv_heads,
                            head_dim, block_size, q);
            team_attend(q, pool, block_tables, context_lens, B, heads, kv_heads, head_dim, block_size, width, scale,
                        L->window, a.softcap, attn, &failed);
            if (L->attn_out_norm) {
                team_matmul(&w[O], attn, B, n_attn, y, NULL, plain, s);
                team_norm_add(h, x, y, B, hidden, (const float *)L->attn_out_norm, a, normed);
            } else {
                team_matmul(&w[O], attn, B, n_attn, h, x, plain, s);
            }
            team_matmul(&w[GATE_UP], h, B, hidden, gu, NULL, mlp_norm, s);
            if (L->mlp_out_norm) {
                team_matmul(&w[DOWN], gu, B, intermediate, y, NULL, gate, s);
                team_norm_add(x, h, y, B, hidden, (const float *)L->mlp_out_norm, a, normed);
            } else {
                team_matmul(&w[DOWN], gu, B, intermediate, x, h, gate, s);
            }
        }
    }
    scratch_free(&s);
    free(qkv); free(q); free(attn); free(h); free(gu); free(y); free(normed);
    return failed ? -1 : 0;
}
