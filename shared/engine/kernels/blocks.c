/* Products with a GGUF file's own Q4_1 / Q8_0 blocks on CPU (weights.py, PD_WEIGHTS=native).

   y (M, N) = x (M, K) @ W.T, W (N, K) kept as the file's blocks of 32 weights, byte for byte:
     Q4_1 (20 bytes): fp16 d, fp16 m, then 16 bytes of q in 0..15 (element i in the low nibble of
           byte i, element 16 + i in its high nibble); w = d·q + m;
     Q8_0 (34 bytes): fp16 d, then 32 int8 q; w = d·q.
   Each row of x is first quantized the way llama.cpp does it (Q8_1: per block of 32,
   dx = max|x| / 127, xq = round(x / dx), sx = dx·Σxq), so a block's product is an integer dot
   product: Q4_1 gives dw·dx·Σ q·xq + m·sx, Q8_0 gives dw·dx·Σ q·xq. With AVX2 the dot is
   _mm256_maddubs_epi16 (32 multiply-adds an instruction); without it, plain C.
   Threads: OpenMP over output rows (the runtime torch already loaded, libgomp.so.1). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QK 32
#define TILE 4 /* rows of x a loaded weight block is used for */

enum { Q4_1 = 0, Q8_0 = 1 };

static inline float fp16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
    float f;
    if (exp == 0) f = ldexpf((float)man, -24);                  /* zero and subnormals */
    else if (exp == 31) f = man ? NAN : INFINITY;
    else f = ldexpf((float)(man | 0x400), (int)exp - 25);
    uint32_t u;
    memcpy(&u, &f, 4);
    u |= sign;
    memcpy(&f, &u, 4);
    return f;
#endif
}

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

#ifdef __AVX2__
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 32 weights of a block as unsigned (Q4_1: q) or |q| (Q8_0), and the sign to put on x. */
static inline __m256i load_q4(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    const __m256i both = _mm256_set_m128i(_mm_srli_epi16(raw, 4), raw);
    return _mm256_and_si256(both, _mm256_set1_epi8(0x0F));
}

static inline __m256 dot_block(__m256i w, __m256i x) {
    const __m256i p16 = _mm256_maddubs_epi16(w, x);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}
#endif

/* One output row against rows t0..t0+nt of x (nt a constant where inlined: the accumulators
   stay in registers). One accumulator a row of x, blocks in order, as row_pair's: a row of x
   gets the same sums to the bit whatever else is in the batch. */
static inline __attribute__((always_inline)) void row_tile(
        int kind, const uint8_t *w8, int64_t nb,
        const int8_t *xq, const float *dx, const float *sx, int64_t K, int64_t t0, const int nt, float *out) {
#ifdef __AVX2__
    __m256 acc[TILE];
    float extra[TILE];
    for (int t = 0; t < nt; t++) {
        acc[t] = _mm256_setzero_ps();
        extra[t] = 0.0f;
    }
    if (kind == Q4_1) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w8 + b * 20;
            const float d = fp16(blk), m = fp16(blk + 2);
            const __m256i w = load_q4(blk + 4);
            for (int t = 0; t < nt; t++) {
                const int64_t xb = (t0 + t) * nb + b;
                const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + (t0 + t) * K + b * QK));
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[xb]), dot_block(w, x), acc[t]);
                extra[t] = fmaf(m, sx[xb], extra[t]);  /* fmaf in both paths: alike to the bit */
            }
        }
    } else {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = w8 + b * 34;
            const float d = fp16(blk);
            const __m256i w = _mm256_loadu_si256((const __m256i *)(blk + 2));
            const __m256i aw = _mm256_sign_epi8(w, w);
            for (int t = 0; t < nt; t++) {
                const int64_t xb = (t0 + t) * nb + b;
                const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + (t0 + t) * K + b * QK));
                acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx[xb]), dot_block(aw, _mm256_sign_epi8(x, w)), acc[t]);
            }
        }
    }
    for (int t = 0; t < nt; t++) out[t] = hsum(acc[t]) + extra[t];
#else
    for (int t = 0; t < nt; t++) {
        float sum = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t xb = (t0 + t) * nb + b;
            const int8_t *x = xq + (t0 + t) * K + b * QK;
            int dot = 0;
            if (kind == Q4_1) {
                const uint8_t *blk = w8 + b * 20, *q = blk + 4;
                for (int j = 0; j < 16; j++) dot += (q[j] & 0x0F) * x[j] + (q[j] >> 4) * x[j + 16];
                sum += fp16(blk) * dx[xb] * (float)dot + fp16(blk + 2) * sx[xb];
            } else {
                const uint8_t *blk = w8 + b * 34;
                const int8_t *q = (const int8_t *)(blk + 2);
                for (int j = 0; j < QK; j++) dot += q[j] * x[j];
                sum += fp16(blk) * dx[xb] * (float)dot;
            }
        }
        out[t] = sum;
    }
#endif
}

#ifdef __AVX2__
/* Two output rows (w8 and w8 + row_bytes) against one row of x, the decode step's shape: each
   block of x is loaded once for both, and the two rows' multiply-adds interleave. (Prefetching
   past the matrix's end is harmless: a prefetch never faults.) */
static void row_pair(int kind, const uint8_t *w8, int64_t row_bytes, int64_t nb, const int8_t *xq,
                     const float *dx, const float *sx, float *out) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float extra0 = 0.0f, extra1 = 0.0f;
    const uint8_t *w1 = w8 + row_bytes, *next = w8 + 2 * row_bytes;
    const int64_t bytes = kind == Q4_1 ? 20 : 34;
    for (int64_t b = 0; b < nb; b++) {
        /* the next pair's rows, as fast as these are read: the weights stream from memory once
           a step, and the hardware's prefetcher alone leaves a Q8_0 product waiting on it */
        _mm_prefetch((const char *)(next + 2 * b * bytes), _MM_HINT_T0);
        if (kind == Q8_0) _mm_prefetch((const char *)(next + 2 * b * bytes + 64), _MM_HINT_T0);
        const __m256i x = _mm256_loadu_si256((const __m256i *)(xq + b * QK));
        if (kind == Q4_1) {
            const uint8_t *b0 = w8 + b * 20, *b1 = w1 + b * 20;
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(fp16(b0) * dx[b]), dot_block(load_q4(b0 + 4), x), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(fp16(b1) * dx[b]), dot_block(load_q4(b1 + 4), x), acc1);
            extra0 = fmaf(fp16(b0 + 2), sx[b], extra0);
            extra1 = fmaf(fp16(b1 + 2), sx[b], extra1);
        } else {
            const uint8_t *b0 = w8 + b * 34, *b1 = w1 + b * 34;
            const __m256i q0 = _mm256_loadu_si256((const __m256i *)(b0 + 2));
            const __m256i q1 = _mm256_loadu_si256((const __m256i *)(b1 + 2));
            acc0 = _mm256_fmadd_ps(_mm256_set1_ps(fp16(b0) * dx[b]),
                                   dot_block(_mm256_sign_epi8(q0, q0), _mm256_sign_epi8(x, q0)), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_set1_ps(fp16(b1) * dx[b]),
                                   dot_block(_mm256_sign_epi8(q1, q1), _mm256_sign_epi8(x, q1)), acc1);
        }
    }
    out[0] = hsum(acc0) + extra0;
    out[1] = hsum(acc1) + extra1;
}
#endif

/* One output row against every row of x, TILE rows of x at a time. */
static void row(int kind, const uint8_t *w8, int64_t nb,
                const int8_t *xq, const float *dx, const float *sx, int64_t K, int64_t M, int64_t N, float *y) {
    float out[TILE];
    for (int64_t t0 = 0; t0 < M; t0 += TILE) {
        const int64_t nt = M - t0 < TILE ? M - t0 : TILE;
        switch (nt) {  /* a constant tile width for each inlined copy */
            case 1: row_tile(kind, w8, nb, xq, dx, sx, K, t0, 1, out); break;
            case 2: row_tile(kind, w8, nb, xq, dx, sx, K, t0, 2, out); break;
            case 3: row_tile(kind, w8, nb, xq, dx, sx, K, t0, 3, out); break;
            default: row_tile(kind, w8, nb, xq, dx, sx, K, t0, TILE, out); break;
        }
        for (int64_t t = 0; t < nt; t++) y[(t0 + t) * N] = out[t];
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

/* The product below, by the threads of the enclosing parallel region, each calling it (its
   loops are OpenMP work-sharing: outside a region, one thread does it all). K % 32 == 0. */
static void team_matmul(int kind, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y,
                        const float *residual, struct prologue p, struct scratch s) {
    const int64_t nb = K / QK, row_bytes = nb * (kind == Q4_1 ? 20 : 34), width = p.swiglu ? 2 * K : K;
#pragma omp for schedule(static)
    for (int64_t t = 0; t < M; t++)
        quantize_row(x + t * width, K, p, s.a + t * K, s.xq + t * K, s.dx + t * nb, s.sx + t * nb);
#ifdef __AVX2__
    if (M == 1 && N % 2 == 0) {
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n += 2) row_pair(kind, w + n * row_bytes, row_bytes, nb, s.xq, s.dx, s.sx, y + n);
    } else
#endif
    {
#pragma omp for schedule(static)
        for (int64_t n = 0; n < N; n++) row(kind, w + n * row_bytes, nb, s.xq, s.dx, s.sx, K, M, N, y + n);
    }
    if (residual) {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < M * N; i++) y[i] += residual[i];
    }
}

/* y (M, N) = residual + prologue(x) (M, K) @ W.T; w (N, K/32 blocks) as in the file; x rows
   K wide (2K with swiglu), residual (M, N) or NULL, norm (K) or NULL. Returns 0, or -1 when K
   is not a multiple of 32 or scratch memory is short. */
int blocks_matmul(int kind, const float *x, int64_t M, int64_t K, const uint8_t *w, int64_t N, float *y,
                  const float *residual, const float *norm, float eps, int swiglu, int threads) {
    if (K % QK != 0) return -1;
    const struct prologue p = {norm, eps, swiglu};
    struct scratch s;
    if (scratch_alloc(&s, M, K) != 0) {
        scratch_free(&s);
        return -1;
    }
#pragma omp parallel num_threads(threads) if (N * M * K >= 32768)
    team_matmul(kind, x, M, K, w, N, y, residual, p, s);
    scratch_free(&s);
    return 0;
}
