/* Products with a GGUF file's own blocks on CPU (weights.py: PD_WEIGHTS native, or auto on CPU).

   y (M, N) = x (M, K) @ W.T, W (N, K) kept as the file's blocks, byte for byte: Q4_0, Q4_1,
   Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K (formats.c), up to PARTS row ranges of different formats
   stacked along the output (q, k and v of one projection in a Q4_K_M file). Each row of x is
   first quantized the way llama.cpp does it (per 32: dx = max|x| / 127, xq = round(x / dx),
   sx = dx·Σxq), so a group of 32 weights costs one integer dot product and one float
   multiply-add (formats.c). With AVX2 the dot is _mm256_maddubs_epi16 (32 multiply-adds an
   instruction), with AVX-512 VNNI _mm256_dpbusd_epi32; without AVX2, plain C. The sums are
   integers, so every path gives a row the same products.
   Threads: OpenMP over output rows (the runtime torch already loaded, libgomp.so.1). */

#include <stdlib.h>

#include "formats.c"
#include "steps.c"

#define PARTS 3

/* A matrix as the caller passes it (int64 each, weights.py's `Packed.descriptor`): its parts'
   formats, rows and addresses, stacked along the output. */
struct matrix {
    int64_t parts, kind[PARTS], rows[PARTS], addr[PARTS];
};

/* One row of x (after the prologue, in a K-float scratch row) -> xq (K) int8, dx and sx (K/32). */
static void quantize_row(const float *x, int64_t K, struct prologue p, float *a, int8_t *xq, float *dx, float *sx) {
    if (p.gate) {
        int64_t j = 0;
#ifdef __AVX2__
        for (; j + 8 <= K; j += 8)
            _mm256_storeu_ps(a + j, gated8(p.gate, _mm256_loadu_ps(x + j), _mm256_loadu_ps(x + K + j)));
#endif
        for (; j < K; j++) a[j] = gated(p.gate, x[j], x[K + j]);
    } else {
        memcpy(a, x, sizeof(float) * (size_t)K);
    }
    if (p.norm) rms_norm(a, a, p.norm, K, p.eps, p.plus_one);
    for (int64_t i = 0; i < K / QK; i++) {
        const float *v = a + i * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
        const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            const int q = (int)nearbyintf(v[j] * id);
            xq[i * QK + j] = (int8_t)q;
            sum += q;
        }
        dx[i] = d;
        sx[i] = d * (float)sum;
    }
}

/* Quantized rows of x: xq (M, K), dx and sx (M, K/32); with AVX2, also as tiles of ROWS rows
   (the last one padded with zero rows): a tile's group g is 8 chunks of 4 activations, each
   chunk the tile's rows side by side (xi: 256 bytes a group), and its dx and sx the rows' side by
   side (dxi, sxi: ROWS floats a group). */
#define ROWS 8
#define FEW 3 /* rows of x up to which the pair path beats a tile padded to ROWS (measured) */
struct acts {
    const int8_t *xq, *xi;
    const float *dx, *sx, *dxi, *sxi;
    int64_t K;
};

/* A group's share of a product, the same float steps on every path: acc += d·dx·isum and, for
   a format with an offset, off += m·sx; the product is acc + off (two sums: one multiply-add
   each a group waits on the last, not two). */
static inline void group_add(const int kind, float *acc, float *off, float d, float m, float dx, float sx, int isum) {
    *acc = fmaf(d * dx, (float)isum, *acc);
    if (!signed_format(kind)) *off = fmaf(m, sx, *off);
}

#ifdef __AVX2__
/* One output row (w8, in `kind`) against nt tiles of ROWS rows of x (nt a constant where
   inlined), tile i at xi + i·stride (dxi, sxi + i·fstride): lane t of out[i] is the product of
   tile i's row t. Each group's 32 weights are unpacked once for the nt tiles and broadcast 4
   at a time against a tile's chunks (one dot instruction for 8 rows' 4 products), then scaled
   by the 8 rows' dx at once. */
static inline __attribute__((always_inline)) void row_tiles(const int kind, const uint8_t *w8, const int8_t *xi,
                                                            const float *dxi, const float *sxi, int64_t nb,
                                                            int64_t stride, int64_t fstride, const int nt,
                                                            __m256 *out) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()}, off[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    uint8_t wq[QK] __attribute__((aligned(32)));
    const int per = (int)(BLOCK_WEIGHTS[kind] / QK);  /* groups a block */
    for (int64_t blk = 0; blk < nb / per; blk++) {
        const uint8_t *b = w8 + blk * BLOCK_BYTES[kind];
#pragma GCC unroll 8
        for (int sub = 0; sub < per; sub++) {  /* a constant in each unrolled copy */
            const int64_t g = blk * per + sub;
            int s0, s1;
            float d, m;
            group_scales(kind, b, sub, &d, &m, &s0, &s1);
            _mm256_store_si256((__m256i *)wq, group_vector(kind, b, sub));
            __m256i sum0[2], sum1[2];
            for (int i = 0; i < nt; i++) sum0[i] = sum1[i] = _mm256_setzero_si256();
            for (int k = 0; k < QK / 4; k++) {
                int32_t chunk;
                memcpy(&chunk, wq + 4 * k, 4);
                const __m256i w = _mm256_set1_epi32(chunk);
                const __m256i u = signed_format(kind) ? _mm256_sign_epi8(w, w) : w;
                for (int i = 0; i < nt; i++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xi + i * stride + g * ROWS * QK + k * 32));
                    const __m256i sv = signed_format(kind) ? _mm256_sign_epi8(xv, w) : xv;
                    if (kind == Q6_K && k >= QK / 8) sum1[i] = dot_add(sum1[i], u, sv);
                    else sum0[i] = dot_add(sum0[i], u, sv);
                }
            }
            for (int i = 0; i < nt; i++) {
                if (kind == Q6_K)
                    sum0[i] = _mm256_add_epi32(_mm256_mullo_epi32(sum0[i], _mm256_set1_epi32(s0)),
                                               _mm256_mullo_epi32(sum1[i], _mm256_set1_epi32(s1)));
                const float *dx = dxi + i * fstride + g * ROWS, *sx = sxi + i * fstride + g * ROWS;
                acc[i] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(dx)),
                                         _mm256_cvtepi32_ps(sum0[i]), acc[i]);
                if (!signed_format(kind)) off[i] = _mm256_fmadd_ps(_mm256_set1_ps(m), _mm256_loadu_ps(sx), off[i]);
            }
        }
    }
    for (int i = 0; i < nt; i++) out[i] = _mm256_add_ps(acc[i], off[i]);
}

/* One output row against every tile of x, two tiles at a time. */
static inline __attribute__((always_inline)) void row_all(const int kind, const uint8_t *w8, struct acts a, int64_t M,
                                                          int64_t ldy, float *y) {
    const int64_t nb = a.K / QK, stride = nb * ROWS * QK, fstride = nb * ROWS;
    float out[2 * ROWS];
    __m256 v[2];
    for (int64_t t0 = 0; t0 < M; t0 += 2 * ROWS) {
        const int64_t tile = t0 / ROWS;
        const int nt = M - t0 > ROWS ? 2 : 1;
        if (nt == 2) row_tiles(kind, w8, a.xi + tile * stride, a.dxi + tile * fstride, a.sxi + tile * fstride, nb,
                               stride, fstride, 2, v);
        else row_tiles(kind, w8, a.xi + tile * stride, a.dxi + tile * fstride, a.sxi + tile * fstride, nb,
                       stride, fstride, 1, v);
        for (int i = 0; i < nt; i++) _mm256_storeu_ps(out + i * ROWS, v[i]);
        for (int64_t t = 0; t < nt * ROWS && t0 + t < M; t++) y[(t0 + t) * ldy] = out[t];
    }
}

/* Two output rows (w8 and w8 + row_bytes) against M rows of x (1 to FEW, a constant where
   inlined), the decode step's shape: each group of the two rows is unpacked once for the M rows
   and each row of x loaded once for both, and every product summed as the pair path sums it
   alone. (Prefetching past the matrix's end is harmless: a prefetch never faults.) */
static inline __attribute__((always_inline)) void row_pair(const int kind, const uint8_t *w8, int64_t row_bytes,
                                                           struct acts a, const int M, int64_t ldy, float *out) {
    const int64_t nb = a.K / QK;
    float acc0[FEW] = {0}, acc1[FEW] = {0}, off0[FEW] = {0}, off1[FEW] = {0};
    const uint8_t *w1 = w8 + row_bytes, *next = w8 + 2 * row_bytes;
    const int64_t step = 2 * (row_bytes / nb);  /* the next pair's bytes a group, near enough */
    const int per = (int)(BLOCK_WEIGHTS[kind] / QK);  /* groups a block */
    for (int64_t blk = 0; blk < nb / per; blk++) {
        const uint8_t *b0 = w8 + blk * BLOCK_BYTES[kind], *b1 = w1 + blk * BLOCK_BYTES[kind];
#pragma GCC unroll 8
        for (int sub = 0; sub < per; sub++) {  /* a constant in each unrolled copy */
            const int64_t g = blk * per + sub;
            /* the next pair's rows, as fast as these are read: the weights stream from memory once
               a step, and the hardware's prefetcher alone leaves the product waiting on it */
            _mm_prefetch((const char *)(next + g * step), _MM_HINT_T0);
            _mm_prefetch((const char *)(next + g * step + 64), _MM_HINT_T0);
            int s0, s1, r0, r1;
            float d0, m0, d1, m1;
            group_scales(kind, b0, sub, &d0, &m0, &s0, &s1);
            group_scales(kind, b1, sub, &d1, &m1, &r0, &r1);
            const __m256i v0 = group_vector(kind, b0, sub), v1 = group_vector(kind, b1, sub);
            for (int t = 0; t < M; t++) {
                const __m256i x = _mm256_loadu_si256((const __m256i *)(a.xq + t * a.K + g * QK));
                const __m128i sums = hsum_pair(group_dot(kind, v0, x, s0, s1), group_dot(kind, v1, x, r0, r1));
                const float dx = a.dx[t * nb + g], sx = a.sx[t * nb + g];
                group_add(kind, &acc0[t], &off0[t], d0, m0, dx, sx, _mm_cvtsi128_si32(sums));
                group_add(kind, &acc1[t], &off1[t], d1, m1, dx, sx, _mm_extract_epi32(sums, 1));
            }
        }
    }
    for (int t = 0; t < M; t++) {
        out[t * ldy] = acc0[t] + off0[t];
        out[t * ldy + 1] = acc1[t] + off1[t];
    }
}

#define PAIR_FORMATS(M)                                                   \
    switch (kind) { /* one inlined copy a format */                       \
        case Q4_0: row_pair(Q4_0, w8, row_bytes, a, M, ldy, out); break;  \
        case Q4_1: row_pair(Q4_1, w8, row_bytes, a, M, ldy, out); break;  \
        case Q5_0: row_pair(Q5_0, w8, row_bytes, a, M, ldy, out); break;  \
        case Q5_1: row_pair(Q5_1, w8, row_bytes, a, M, ldy, out); break;  \
        case Q8_0: row_pair(Q8_0, w8, row_bytes, a, M, ldy, out); break;  \
        case Q4_K: row_pair(Q4_K, w8, row_bytes, a, M, ldy, out); break;  \
        case Q5_K: row_pair(Q5_K, w8, row_bytes, a, M, ldy, out); break;  \
        default: row_pair(Q6_K, w8, row_bytes, a, M, ldy, out); break;    \
    }

static void pair(int kind, const uint8_t *w8, int64_t row_bytes, struct acts a, int64_t M, int64_t ldy, float *out) {
    switch (M) {  /* one copy a count of rows, each unrolled */
        case 1: PAIR_FORMATS(1) break;
        case 2: PAIR_FORMATS(2) break;
        case 3: PAIR_FORMATS(3) break;
        default: break;
    }
}
#else
/* One output row against every row of x, in plain C: each group unpacked once for ROWS rows. */
static inline __attribute__((always_inline)) void row_all(const int kind, const uint8_t *w8, struct acts a, int64_t M,
                                                          int64_t ldy, float *y) {
    const int64_t nb = a.K / QK;
    for (int64_t t0 = 0; t0 < M; t0 += ROWS) {
        const int64_t nt = M - t0 < ROWS ? M - t0 : ROWS;
        float acc[ROWS] = {0}, off[ROWS] = {0};
        const int per = (int)(BLOCK_WEIGHTS[kind] / QK);  /* groups a block */
        for (int64_t blk = 0; blk < nb / per; blk++) {
            const uint8_t *b = w8 + blk * BLOCK_BYTES[kind];
#pragma GCC unroll 8
            for (int sub = 0; sub < per; sub++) {  /* a constant in each unrolled copy */
                const int64_t g = blk * per + sub;
                int s0, s1;
                float d, m;
                int8_t q[QK];
                group_scales(kind, b, sub, &d, &m, &s0, &s1);
                group_ints(kind, b, sub, q);
                for (int64_t t = 0; t < nt; t++) {
                    const int64_t xg = (t0 + t) * nb + g;
                    const int8_t *x = a.xq + xg * QK;
                    int dot0 = 0, dot1 = 0;
                    for (int j = 0; j < 16; j++) {
                        dot0 += q[j] * x[j];
                        dot1 += q[j + 16] * x[j + 16];
                    }
                    group_add(kind, &acc[t], &off[t], d, m, a.dx[xg], a.sx[xg], s0 * dot0 + s1 * dot1);
                }
            }
        }
        for (int64_t t = 0; t < nt; t++) y[(t0 + t) * ldy] = acc[t] + off[t];
    }
}
#endif

static void row(int kind, const uint8_t *w8, struct acts a, int64_t M, int64_t ldy, float *y) {
    switch (kind) {  /* one inlined copy a format */
        case Q4_0: row_all(Q4_0, w8, a, M, ldy, y); break;
        case Q4_1: row_all(Q4_1, w8, a, M, ldy, y); break;
        case Q5_0: row_all(Q5_0, w8, a, M, ldy, y); break;
        case Q5_1: row_all(Q5_1, w8, a, M, ldy, y); break;
        case Q8_0: row_all(Q8_0, w8, a, M, ldy, y); break;
        case Q4_K: row_all(Q4_K, w8, a, M, ldy, y); break;
        case Q5_K: row_all(Q5_K, w8, a, M, ldy, y); break;
        default: row_all(Q6_K, w8, a, M, ldy, y); break;
    }
}

/* Scratch for quantizing M rows K wide: the prologue's row (floats), xq, dx and sx, and their
   tiles (xi, dxi, sxi). */
struct scratch {
    float *a, *dx, *sx, *dxi, *sxi;
    int8_t *xq, *xi;
};

static int scratch_alloc(struct scratch *s, int64_t M, int64_t K) {
    const int64_t padded = (M + ROWS - 1) / ROWS * ROWS;
    s->xq = malloc((size_t)(M * K));
    s->xi = malloc((size_t)(padded * K));
    s->a = malloc(sizeof(float) * (size_t)(M * K));
    s->dx = malloc(sizeof(float) * (size_t)(M * (K / QK)));
    s->sx = malloc(sizeof(float) * (size_t)(M * (K / QK)));
    s->dxi = malloc(sizeof(float) * (size_t)(padded * (K / QK)));
    s->sxi = malloc(sizeof(float) * (size_t)(padded * (K / QK)));
    return s->xq && s->xi && s->a && s->dx && s->sx && s->dxi && s->sxi ? 0 : -1;
}

static void scratch_free(struct scratch *s) {
    free(s->xq); free(s->xi); free(s->a); free(s->dx); free(s->sx); free(s->dxi); free(s->sxi);
}

#ifdef __AVX2__
/* Tile `tile` of the quantized rows, laid out as struct acts says (rows past M are zeros). */
static void interleave(struct scratch s, int64_t M, int64_t K, int64_t tile) {
    const int64_t nb = K / QK;
    for (int64_t g = 0; g < nb; g++) {
        int8_t *xi = s.xi + (tile * nb + g) * ROWS * QK;
        for (int64_t t = 0; t < ROWS; t++) {
            const int64_t r = tile * ROWS + t;
            for (int k = 0; k < QK / 4; k++) {
                if (r < M) memcpy(xi + k * 32 + t * 4, s.xq + r * K + g * QK + k * 4, 4);
                else memset(xi + k * 32 + t * 4, 0, 4);
            }
            s.dxi[(tile * nb + g) * ROWS + t] = r < M ? s.dx[r * nb + g] : 0.0f;
            s.sxi[(tile * nb + g) * ROWS + t] = r < M ? s.sx[r * nb + g] : 0.0f;
        }
    }
}
#endif

static int64_t matrix_rows(const struct matrix *w) {
    int64_t n = 0;
    for (int64_t p = 0; p < w->parts; p++) n += w->rows[p];
    return n;
}

/* Whether every part's rows are whole blocks of K and in a known format. */
static int matrix_valid(const struct matrix *w, int64_t K) {
    if (w->parts < 1 || w->parts > PARTS || K % QK) return 0;
    for (int64_t p = 0; p < w->parts; p++)
        if (w->kind[p] < 0 || w->kind[p] >= FORMATS || K % BLOCK_WEIGHTS[w->kind[p]]) return 0;
    return 1;
}

/* Output row n's part, and the row's address in it. */
static inline int64_t part_of(const struct matrix *w, int64_t K, int64_t n, const uint8_t **row, int64_t *row_bytes) {
    int64_t p = 0;
    while (n >= w->rows[p]) n -= w->rows[p++];
    *row_bytes = K / BLOCK_WEIGHTS[w->kind[p]] * BLOCK_BYTES[w->kind[p]];
    *row = (const uint8_t *)w->addr[p] + n * *row_bytes;
    return p;
}

#define X_BYTES (256 * 1024)

/* The product below, by the threads of the enclosing parallel region, each calling it (its
   loops are OpenMP work-sharing: outside a region, one thread does it all). */
static void team_matmul(const struct matrix *w, const float *x, int64_t M, int64_t K, float *y,
                        const float *residual, struct prologue p, struct scratch s) {
    const int64_t nb = K / QK, width = p.gate ? 2 * K : K, N = matrix_rows(w);
    const struct acts a = {s.xq, s.xi, s.dx, s.sx, s.dxi, s.sxi, K};
#pragma omp for schedule(static)
    for (int64_t t = 0; t < M; t++)
        quantize_row(x + t * width, K, p, s.a + t * K, s.xq + t * K, s.dx + t * nb, s.sx + t * nb);
    int even = 1;
    for (int64_t q = 0; q < w->parts; q++) even &= w->rows[q] % 2 == 0;
#ifdef __AVX2__
    if (M > FEW || !even) {
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < (M + ROWS - 1) / ROWS; tile++) interleave(s, M, K, tile);
    }
    if (M >= 1 && M <= FEW && even) {  /* (M = 0, no row of x: neither path has anything to do) */
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n += 2) {
            const uint8_t *w8;
            int64_t row_bytes;
            const int kind = (int)w->kind[part_of(w, K, n, &w8, &row_bytes)];
            pair(kind, w8, row_bytes, a, M, N, y + n);
        }
    } else
#endif
    {
        (void)even;
        /* rows of x a block, whole pairs of tiles: their quantized rows (~X_BYTES) stay in the
           core's L2 while the thread's share of output rows is taken against them */
        const int64_t fit = X_BYTES / K / (2 * ROWS) * (2 * ROWS), per_block = fit > 0 ? fit : 2 * ROWS;
        for (int64_t m0 = 0; m0 < M; m0 += per_block) {
            const int64_t mb = M - m0 < per_block ? M - m0 : per_block;
            const struct acts sub = {a.xq + m0 * K, a.xi + m0 * K, a.dx + m0 * nb, a.sx + m0 * nb, a.dxi + m0 * nb,
                                     a.sxi + m0 * nb, K};
#pragma omp for schedule(static) nowait
            for (int64_t n = 0; n < N; n++) {  /* (the same rows to each thread in every block) */
                const uint8_t *w8;
                int64_t row_bytes;
                const int kind = (int)w->kind[part_of(w, K, n, &w8, &row_bytes)];
                row(kind, w8, sub, mb, N, y + m0 * N + n);
            }
        }
#pragma omp barrier
    }
    if (residual) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * N; i++) y[i] += residual[i];
    }
}

/* y (M, N) = residual + prologue(x) (M, K) @ W.T; w the matrix's descriptor (N rows in all); x
   rows K wide (2K with a gate), residual (M, N) or NULL, norm (K) or NULL. Returns 0, or -1
   when K is not whole blocks of every part's format or scratch memory is short. */
int blocks_matmul(const struct matrix *w, const float *x, int64_t M, int64_t K, float *y,
                  const float *residual, const float *norm, float eps, int plus_one, int gate, int threads) {
    if (!matrix_valid(w, K)) return -1;
    const struct prologue p = {norm, eps, gate, plus_one};
    struct scratch s;
    if (scratch_alloc(&s, M, K) != 0) {
        scratch_free(&s);
        return -1;
    }
#pragma omp parallel num_threads(threads) if (matrix_rows(w) * M * K >= 32768)
    team_matmul(w, x, M, K, y, residual, p, s);
    scratch_free(&s);
    return 0;
}
