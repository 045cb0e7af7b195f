/* Products with a GGUF file's own blocks on CPU (weights.py, PD_WEIGHTS=native).

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

#define TILE 4  /* rows of x a loaded weight group is used for */
#define PARTS 3

/* A matrix as the caller passes it (int64 each, weights.py's `Packed.descriptor`): its parts'
   formats, rows and addresses, stacked along the output. */
struct matrix {
    int64_t parts, kind[PARTS], rows[PARTS], addr[PARTS];
};

/* What the kernel does to a row of x before the product (the layer's element-wise steps, so
   they cost no pass of their own): with `swiglu` the row is (gate, up), 2K wide, and becomes
   silu(gate)·up; with `norm` it is RMS-normalized and scaled by norm's weights. */
struct prologue {
    const float *norm;
    float eps;
    int swiglu;
};

/* One row of x (after the prologue, in a K-float scratch row) -> xq (K) int8, dx and sx (K/32). */
static void quantize_row(const float *x, int64_t K, struct prologue p, float *a, int8_t *xq, float *dx, float *sx) {
    if (p.swiglu) {
        for (int64_t j = 0; j < K; j++) a[j] = x[j] / (1.0f + expf(-x[j])) * x[K + j];
    } else {
        memcpy(a, x, sizeof(float) * (size_t)K);
    }
    if (p.norm) {
        float ss = 0.0f;
        for (int64_t j = 0; j < K; j++) ss += a[j] * a[j];
        const float r = 1.0f / sqrtf(ss / (float)K + p.eps);
        for (int64_t j = 0; j < K; j++) a[j] = a[j] * r * p.norm[j];
    }
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

/* Quantized rows of x: xq (M, K), dx and sx (M, K/32). */
struct acts {
    const int8_t *xq;
    const float *dx, *sx;
    int64_t K;
};

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* One output row (w8, in `kind`) against rows t0..t0+nt of x (nt a constant where inlined: the
   accumulators stay in registers). One accumulator a row of x, groups in order, as row_pair's:
   a row of x gets the same sums to the bit whatever else is in the batch. */
static inline __attribute__((always_inline)) void row_tile(const int kind, const uint8_t *w8, struct acts a,
                                                           int64_t t0, const int nt, float *out) {
    const int64_t nb = a.K / QK;
#ifdef __AVX2__
    __m256 acc[TILE];
    float extra[TILE];
    for (int t = 0; t < nt; t++) {
        acc[t] = _mm256_setzero_ps();
        extra[t] = 0.0f;
    }
    for (int64_t g = 0; g < nb; g++) {
        int sub, s0, s1;
        float d, m;
        const uint8_t *b = block_of(kind, w8, g, &sub);
        group_scales(kind, b, sub, &d, &m, &s0, &s1);
        const __m256i q = group_vector(kind, b, sub), scales = group_scale_vector(s0, s1);
        for (int t = 0; t < nt; t++) {
            const int64_t xg = (t0 + t) * nb + g;
            const __m256i x = _mm256_loadu_si256((const __m256i *)(a.xq + xg * QK));
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * a.dx[xg]), group_dot(kind, q, x, scales), acc[t]);
            extra[t] = fmaf(m, a.sx[xg], extra[t]);  /* fmaf in every path: alike to the bit */
        }
    }
    for (int t = 0; t < nt; t++) out[t] = hsum(acc[t]) + extra[t];
#else
    for (int t = 0; t < nt; t++) out[t] = 0.0f;
    for (int64_t g = 0; g < nb; g++) {
        int sub, s0, s1;
        float d, m;
        int8_t q[QK];
        const uint8_t *b = block_of(kind, w8, g, &sub);
        group_scales(kind, b, sub, &d, &m, &s0, &s1);
        group_ints(kind, b, sub, q);
        for (int t = 0; t < nt; t++) {
            const int64_t xg = (t0 + t) * nb + g;
            const int8_t *x = a.xq + xg * QK;
            int dot0 = 0, dot1 = 0;
            for (int j = 0; j < 16; j++) {
                dot0 += q[j] * x[j];
                dot1 += q[j + 16] * x[j + 16];
            }
            out[t] += d * a.dx[xg] * (float)(s0 * dot0 + s1 * dot1) + m * a.sx[xg];
        }
    }
#endif
}

#ifdef __AVX2__
/* Two output rows (w8 and w8 + row_bytes) against one row of x, the decode step's shape: each
   group of x is loaded once for both, and the two rows' multiply-adds interleave. (Prefetching
   past the matrix's end is harmless: a prefetch never faults.) */
static inline __attribute__((always_inline)) void row_pair(const int kind, const uint8_t *w8, int64_t row_bytes,
                                                           struct acts a, float *out) {
    const int64_t nb = a.K / QK;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float extra0 = 0.0f, extra1 = 0.0f;
    const uint8_t *w1 = w8 + row_bytes, *next = w8 + 2 * row_bytes;
    const int64_t step = 2 * (row_bytes / nb);  /* the next pair's bytes a group, near enough */
    for (int64_t g = 0; g < nb; g++) {
        /* the next pair's rows, as fast as these are read: the weights stream from memory once
           a step, and the hardware's prefetcher alone leaves the product waiting on it */
        const int64_t ahead = g * step;
        _mm_prefetch((const char *)(next + ahead), _MM_HINT_T0);
        _mm_prefetch((const char *)(next + ahead + 64), _MM_HINT_T0);
        const __m256i x = _mm256_loadu_si256((const __m256i *)(a.xq + g * QK));
        int sub, s0, s1, r0, r1;
        float d0, m0, d1, m1;
        const uint8_t *b0 = block_of(kind, w8, g, &sub), *b1 = block_of(kind, w1, g, &sub);
        group_scales(kind, b0, sub, &d0, &m0, &s0, &s1);
        group_scales(kind, b1, sub, &d1, &m1, &r0, &r1);
        acc0 = _mm256_fmadd_ps(_mm256_set1_ps(d0 * a.dx[g]),
                               group_dot(kind, group_vector(kind, b0, sub), x, group_scale_vector(s0, s1)), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_set1_ps(d1 * a.dx[g]),
                               group_dot(kind, group_vector(kind, b1, sub), x, group_scale_vector(r0, r1)), acc1);
        extra0 = fmaf(m0, a.sx[g], extra0);
        extra1 = fmaf(m1, a.sx[g], extra1);
    }
    out[0] = hsum(acc0) + extra0;
    out[1] = hsum(acc1) + extra1;
}

static void pair(int kind, const uint8_t *w8, int64_t row_bytes, struct acts a, float *out) {
    switch (kind) {  /* one inlined copy a format */
        case Q4_0: row_pair(Q4_0, w8, row_bytes, a, out); break;
        case Q4_1: row_pair(Q4_1, w8, row_bytes, a, out); break;
        case Q5_0: row_pair(Q5_0, w8, row_bytes, a, out); break;
        case Q5_1: row_pair(Q5_1, w8, row_bytes, a, out); break;
        case Q8_0: row_pair(Q8_0, w8, row_bytes, a, out); break;
        case Q4_K: row_pair(Q4_K, w8, row_bytes, a, out); break;
        case Q5_K: row_pair(Q5_K, w8, row_bytes, a, out); break;
        default: row_pair(Q6_K, w8, row_bytes, a, out); break;
    }
}
#endif

/* One output row against every row of x, TILE rows of x at a time. */
static inline __attribute__((always_inline)) void row_all(const int kind, const uint8_t *w8, struct acts a, int64_t M,
                                                          int64_t ldy, float *y) {
    float out[TILE];
    for (int64_t t0 = 0; t0 < M; t0 += TILE) {
        const int64_t nt = M - t0 < TILE ? M - t0 : TILE;
        switch (nt) {  /* a constant tile width for each inlined copy */
            case 1: row_tile(kind, w8, a, t0, 1, out); break;
            case 2: row_tile(kind, w8, a, t0, 2, out); break;
            case 3: row_tile(kind, w8, a, t0, 3, out); break;
            default: row_tile(kind, w8, a, t0, TILE, out); break;
        }
        for (int64_t t = 0; t < nt; t++) y[(t0 + t) * ldy] = out[t];
    }
}

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

/* Scratch for quantizing M rows K wide: the prologue's row (floats), xq, dx and sx. */
struct scratch {
    float *a, *dx, *sx;
    int8_t *xq;
};

static int scratch_alloc(struct scratch *s, int64_t M, int64_t K) {
    s->xq = malloc((size_t)(M * K));
    s->a = malloc(sizeof(float) * (size_t)(M * K));
    s->dx = malloc(sizeof(float) * (size_t)(M * (K / QK)));
    s->sx = malloc(sizeof(float) * (size_t)(M * (K / QK)));
    return s->xq && s->a && s->dx && s->sx ? 0 : -1;
}

static void scratch_free(struct scratch *s) {
    free(s->xq); free(s->a); free(s->dx); free(s->sx);
}

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

/* The product below, by the threads of the enclosing parallel region, each calling it (its
   loops are OpenMP work-sharing: outside a region, one thread does it all). */
static void team_matmul(const struct matrix *w, const float *x, int64_t M, int64_t K, float *y,
                        const float *residual, struct prologue p, struct scratch s) {
    const int64_t nb = K / QK, width = p.swiglu ? 2 * K : K, N = matrix_rows(w);
    const struct acts a = {s.xq, s.dx, s.sx, K};
#pragma omp for schedule(static)
    for (int64_t t = 0; t < M; t++)
        quantize_row(x + t * width, K, p, s.a + t * K, s.xq + t * K, s.dx + t * nb, s.sx + t * nb);
    int even = 1;
    for (int64_t q = 0; q < w->parts; q++) even &= w->rows[q] % 2 == 0;
#ifdef __AVX2__
    if (M == 1 && even) {
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n += 2) {
            const uint8_t *w8;
            int64_t row_bytes;
            const int kind = (int)w->kind[part_of(w, K, n, &w8, &row_bytes)];
            pair(kind, w8, row_bytes, a, y + n);
        }
    } else
#endif
    {
        (void)even;
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) {
            const uint8_t *w8;
            int64_t row_bytes;
            const int kind = (int)w->kind[part_of(w, K, n, &w8, &row_bytes)];
            row(kind, w8, a, M, N, y + n);
        }
    }
    if (residual) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * N; i++) y[i] += residual[i];
    }
}

/* y (M, N) = residual + prologue(x) (M, K) @ W.T; w the matrix's descriptor (N rows in all); x
   rows K wide (2K with swiglu), residual (M, N) or NULL, norm (K) or NULL. Returns 0, or -1
   when K is not whole blocks of every part's format or scratch memory is short. */
int blocks_matmul(const struct matrix *w, const float *x, int64_t M, int64_t K, float *y,
                  const float *residual, const float *norm, float eps, int swiglu, int threads) {
    if (!matrix_valid(w, K)) return -1;
    const struct prologue p = {norm, eps, swiglu};
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
