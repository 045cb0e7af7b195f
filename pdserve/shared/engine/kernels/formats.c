/* A GGUF file's block formats as blocks.c computes with them: every format is read 32 weights
   (a group) at a time, as integers q with a float scale d and offset m,

       w = d·s·q + m        (s: 1, or Q6_K's own scale for each 16 of the 32)

   so that a group's product with 32 activations quantized to 8 bits (xq, scale dx, sum
   sx = dx·Σxq) is an integer dot product: d·dx·Σ s·q·xq + m·sx.

   The formats (llama.cpp's ggml-common.h; bytes a block, weights a block):
     Q4_0 (18, 32)   fp16 d, 16 bytes of nibbles (element i low nibble of byte i, 16 + i high);
                     w = d·(q − 8)
     Q4_1 (20, 32)   fp16 d, fp16 m, nibbles as Q4_0; w = d·q + m
     Q5_0 (22, 32)   fp16 d, 32 high bits (bit i of element i), nibbles; w = d·(q − 16)
     Q5_1 (24, 32)   fp16 d, fp16 m, 32 high bits, nibbles; w = d·q + m
     Q8_0 (34, 32)   fp16 d, 32 int8; w = d·q
     Q4_K (144, 256) fp16 d, fp16 dmin, 12 bytes of 6-bit scales and mins for 8 groups, 128 bytes
                     of nibbles: groups 2j and 2j + 1 are the low and high nibbles of bytes
                     32j..32j + 31; w = d·sc·q − dmin·mn
     Q5_K (176, 256) as Q4_K, then 32 bytes of high bits (group g's in bit g), then nibbles
     Q6_K (210, 256) 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one for 16
                     weights), fp16 d; w = d·sc·(q − 32)
   Q8_0 and Q6_K are read as signed q (s·q·xq through _mm256_sign_epi8); the others as unsigned
   q with m carrying the offset. */

#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif

#define QK 32 /* weights a group */

enum { Q4_1, Q8_0, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, FORMATS };
static const int64_t BLOCK_BYTES[FORMATS] = {20, 34, 18, 22, 24, 144, 176, 210};
static const int64_t BLOCK_WEIGHTS[FORMATS] = {32, 32, 32, 32, 32, 256, 256, 256};

static inline int signed_format(int kind) { return kind == Q8_0 || kind == Q6_K; }

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

/* Q4_K / Q5_K: group j's 6-bit scale and min (llama.cpp's get_scale_min_k4). */
static inline void scale_min(int j, const uint8_t *q, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* The group's d and m (and Q6_K's two scales). */
static inline void group_scales(const int kind, const uint8_t *b, int sub, float *d, float *m, int *s0, int *s1) {
    int sc, mn;
    *m = 0.0f;
    *s0 = *s1 = 1;
    switch (kind) {
        case Q4_0: *d = fp16(b); *m = -8.0f * *d; break;
        case Q5_0: *d = fp16(b); *m = -16.0f * *d; break;
        case Q4_1: case Q5_1: *d = fp16(b); *m = fp16(b + 2); break;
        case Q8_0: *d = fp16(b); break;
        case Q4_K: case Q5_K:
            scale_min(sub, b + 4, &sc, &mn);
            *d = fp16(b) * (float)sc;
            *m = -fp16(b + 2) * (float)mn;
            break;
        default: { /* Q6_K */
            const int8_t *scales = (const int8_t *)(b + 192) + (sub / 4) * 8 + (sub % 4) * 2;
            *d = fp16(b + 208);
            *s0 = scales[0];
            *s1 = scales[1];
        }
    }
}

/* The group's 32 integers, in plain C. */
static inline void group_ints(const int kind, const uint8_t *b, int sub, int8_t *q) {
    uint32_t qh;
    switch (kind) {
        case Q4_0: case Q4_1: {
            const uint8_t *qs = b + (kind == Q4_0 ? 2 : 4);
            for (int j = 0; j < 16; j++) { q[j] = (int8_t)(qs[j] & 0xF); q[j + 16] = (int8_t)(qs[j] >> 4); }
            break;
        }
        case Q5_0: case Q5_1: {
            const uint8_t *h = b + (kind == Q5_0 ? 2 : 4), *qs = h + 4;
            memcpy(&qh, h, 4);
            for (int j = 0; j < 16; j++) {
                q[j] = (int8_t)((qs[j] & 0xF) | ((qh >> j) & 1) << 4);
                q[j + 16] = (int8_t)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4);
            }
            break;
        }
        case Q8_0: memcpy(q, b + 2, QK); break;
        case Q4_K: case Q5_K: {
            const uint8_t *qs = b + (kind == Q4_K ? 16 : 48) + (sub / 2) * 32, *h = b + 16;
            for (int j = 0; j < QK; j++) {
                const int lo = sub & 1 ? qs[j] >> 4 : qs[j] & 0xF;
                q[j] = (int8_t)(kind == Q5_K ? lo | ((h[j] >> sub) & 1) << 4 : lo);
            }
            break;
        }
        default: { /* Q6_K */
            const int half = sub / 4, quarter = sub % 4;
            const uint8_t *ql = b + half * 64 + (quarter & 1) * 32, *h = b + 128 + half * 32;
            for (int j = 0; j < QK; j++)
                q[j] = (int8_t)((((ql[j] >> (quarter >= 2 ? 4 : 0)) & 0xF) | ((h[j] >> (2 * quarter)) & 3) << 4) - 32);
        }
    }
}

#ifdef __AVX2__
static inline __m256i nibbles(const uint8_t *qs) { /* 16 bytes: low nibbles, then high ones */
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(0x0F));
}

static inline __m256i high_bits(const uint8_t *h) { /* 32 bits -> byte i 16 where bit i is set */
    uint32_t bits;
    memcpy(&bits, h, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits),
        _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
    const __m256i bit = _mm256_set1_epi64x((int64_t)0x8040201008040201);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}

static inline __m256i shifted(const uint8_t *p, int by, int mask) { /* (32 bytes >> by) & mask */
    const __m256i v = _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)p), _mm_cvtsi32_si128(by));
    return _mm256_and_si256(v, _mm256_set1_epi8((char)mask));
}

/* The group's 32 integers in a register (as group_ints). */
static inline __attribute__((always_inline)) __m256i group_vector(const int kind, const uint8_t *b, int sub) {
    switch (kind) {
        case Q4_0: return nibbles(b + 2);
        case Q4_1: return nibbles(b + 4);
        case Q5_0: return _mm256_or_si256(nibbles(b + 6), high_bits(b + 2));
        case Q5_1: return _mm256_or_si256(nibbles(b + 8), high_bits(b + 4));
        case Q8_0: return _mm256_loadu_si256((const __m256i *)(b + 2));
        case Q4_K: return shifted(b + 16 + (sub / 2) * 32, (sub & 1) * 4, 0xF);
        case Q5_K: return _mm256_or_si256(shifted(b + 48 + (sub / 2) * 32, (sub & 1) * 4, 0xF),
                                          _mm256_slli_epi16(shifted(b + 16, sub, 1), 4));
        default: { /* Q6_K */
            const int half = sub / 4, quarter = sub % 4;
            const __m256i lo = shifted(b + half * 64 + (quarter & 1) * 32, quarter >= 2 ? 4 : 0, 0xF);
            const __m256i hi = shifted(b + 128 + half * 32, 2 * quarter, 3);
            return _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
        }
    }
}

/* acc + Σ u·s over each 4 bytes (u unsigned, s signed), as 8 int32 lanes. */
static inline __m256i dot_add(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

/* A group's integer dot product with 32 activations, Σ s·q·xq, spread over 8 int32 lanes. */
static inline __attribute__((always_inline)) __m256i group_dot(const int kind, __m256i q, __m256i x, int s0, int s1) {
    if (kind == Q6_K) {
        const __m256i scales = _mm256_set_m128i(_mm_set1_epi16((short)s1), _mm_set1_epi16((short)s0));
        return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q)), scales);
    }
    if (signed_format(kind)) return dot_add(_mm256_setzero_si256(), _mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
    return dot_add(_mm256_setzero_si256(), q, x);
}

/* The sums of a's 8 lanes and of b's, as lanes 0 and 1. */
static inline __m128i hsum_pair(__m256i a, __m256i b) {
    const __m256i h = _mm256_hadd_epi32(a, b);  /* per half: a0+a1, a2+a3, b0+b1, b2+b3 */
    const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
    return _mm_hadd_epi32(s, s);
}
#endif
