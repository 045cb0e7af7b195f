/* The layer's element-wise steps on a row of activations, done by blocks.c's products before
   they quantize the row (so they cost no pass of their own) and by fused.c between them:
   RMSNorm (Llama's, or Gemma's scaled by 1 + w) and the gates (SwiGLU, GeGLU). */

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

/* What the kernel does to a row of x before the product (the layer's element-wise steps, so
   they cost no pass of their own): with a `gate` the row is (gate, up), 2K wide, and becomes
   act(gate)·up, act SiLU or GELU's tanh form; with `norm` it is RMS-normalized and scaled by
   norm's weights (by 1 + the weights with `plus_one`, Gemma's norm). */
enum { NO_GATE, SILU, GELU_TANH };
struct prologue {
    const float *norm;
    float eps;
    int gate, plus_one;
};

/* y = RMSNorm(x) (n floats) scaled by w, or by 1 + w with plus_one; y may be x. */
static void rms_norm(float *y, const float *x, const float *w, int64_t n, float eps, int plus_one) {
    float ss = 0.0f;
    for (int64_t j = 0; j < n; j++) ss += x[j] * x[j];
    const float r = 1.0f / sqrtf(ss / (float)n + eps);
    if (plus_one) {
        for (int64_t j = 0; j < n; j++) y[j] = x[j] * r * (1.0f + w[j]);
    } else {
        for (int64_t j = 0; j < n; j++) y[j] = x[j] * r * w[j];
    }
}

/* e^x as Cephes' expf computes it (x reduced by ln 2, a degree-5 polynomial, times 2^n; within 2
   ulp of expf), so a gate costs a few vector instructions an element instead of a libm call. */
#define EXP_CLAMP 88.3762626647949f
#define EXP_C1 0.693359375f
#define EXP_C2 -2.12194440e-4f
static const float EXP_P[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                               1.6666665459e-1f, 5.0000001201e-1f};

static inline float exp_poly(float x) {
    x = fminf(fmaxf(x, -EXP_CLAMP), EXP_CLAMP);
    const float n = floorf(fmaf(x, 1.44269504088896341f, 0.5f));
    x = fmaf(n, -EXP_C2, fmaf(n, -EXP_C1, x));
    float y = EXP_P[0];
    for (int i = 1; i < 6; i++) y = fmaf(y, x, EXP_P[i]);
    y = fmaf(y, x * x, x + 1.0f);
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return y * scale;
}

/* The gates: act(g)·u, act SiLU (g / (1 + e^-g)) or GELU's tanh form (0.5·g·(1 + tanh(√(2/π)·
   (g + 0.044715·g³))), tanh(v) = 1 - 2 / (e^2v + 1)). */
static inline float gated(int gate, float g, float u) {
    if (gate == SILU) return g / (1.0f + exp_poly(-g)) * u;
    const float v = 0.7978845608028654f * (g + 0.044715f * g * g * g);
    return 0.5f * g * (2.0f - 2.0f / (exp_poly(2.0f * v) + 1.0f)) * u;
}

#ifdef __AVX2__
static inline __m256 exp_poly8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-EXP_CLAMP)), _mm256_set1_ps(EXP_CLAMP));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_C2), _mm256_fmadd_ps(n, _mm256_set1_ps(-EXP_C1), x));
    __m256 y = _mm256_set1_ps(EXP_P[0]);
    for (int i = 1; i < 6; i++) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(EXP_P[i]));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

static inline __m256 gated8(int gate, __m256 g, __m256 u) {
    const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f);
    if (gate == SILU)
        return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, exp_poly8(_mm256_sub_ps(_mm256_setzero_ps(), g)))), u);
    const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), g), g);
    const __m256 v = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_add_ps(g, g3));
    const __m256 t = _mm256_sub_ps(two, _mm256_div_ps(two, _mm256_add_ps(exp_poly8(_mm256_mul_ps(two, v)), one)));
    return _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), g), t), u);
}
#endif
