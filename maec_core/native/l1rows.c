/*
 * Row L1 norms of a difference, bit for bit what torch's CPU
 * `torch.linalg.vector_norm(x - y, 1, dim=1)` returns for float32 x and y:
 * per row, |x[j] - y[j]| added to a float32 sum from j = 0 upwards, one at a time.
 *
 * torch runs that reduction as one dependent chain per row, so it waits on the latency
 * of every add (about 0.75 G elements/s on one core): it is most of the CPU time of a
 * MAEC extraction. Here the order within each row is the same, but 8 rows advance
 * together: 8 independent chains, one SIMD lane each on AVX2 (blocks of 8 x 8 are
 * transposed in registers so lane k holds row k's next eight values in order), else 8
 * scalar accumulators. The sums are therefore identical, bit for bit; the tests compare
 * against torch on every dtype and shape class.
 *
 * Inputs are row-major, contiguous, both of one dtype: bfloat16, float16 (AVX2 + F16C
 * only) or float32. Converting bfloat16 and float16 to float32 is exact, as in torch.
 * Built by `python -m maec_core.native` with the system C compiler; loaded with ctypes.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <immintrin.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };

static inline float from_bf16(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Called only on the AVX2 + F16C path (maec_l1_rows refuses float16 elsewhere). */
__attribute__((target("f16c")))
static float from_f16(uint16_t v) {
    return _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(v)));
}

/* One element as float32. */
static inline float elem(int dt, const void *p, int64_t i) {
    if (dt == DT_BF16) return from_bf16(((const uint16_t *)p)[i]);
    if (dt == DT_F16) return from_f16(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

/* Continue the sums acc[0..n) of rows r.. over columns [j0, width), one at a time. */
static void tail(int dt, const void *x, const void *y, int64_t r, int n, int64_t width,
                 int64_t j0, const float *acc, float *out) {
    for (int k = 0; k < n; k++) {
        float s = acc[k];
        int64_t base = (r + k) * width;
        for (int64_t j = j0; j < width; j++)
            s += fabsf(elem(dt, x, base + j) - elem(dt, y, base + j));
        out[r + k] = s;
    }
}

static void rows_scalar(int dt, const void *x, const void *y, int64_t rows, int64_t width,
                        float *out) {
    int64_t r = 0;
    for (; r + 8 <= rows; r += 8) {
        float a[8] = {0};
        for (int64_t j = 0; j < width; j++)
            for (int k = 0; k < 8; k++) {
                int64_t i = (r + k) * width + j;
                a[k] += fabsf(elem(dt, x, i) - elem(dt, y, i));
            }
        for (int k = 0; k < 8; k++) out[r + k] = a[k];
    }
    const float zero[8] = {0};
    tail(dt, x, y, r, (int)(rows - r), width, 0, zero, out);
}

__attribute__((target("avx2,f16c")))
static inline __m256 load8(int dt, const void *p, int64_t i) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dt == DT_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

__attribute__((target("avx2,f16c")))
static void rows_avx2(int dt, const void *x, const void *y, int64_t rows, int64_t width,
                      float *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    int64_t r = 0;
    for (; r + 8 <= rows; r += 8) {
        __m256 acc = _mm256_setzero_ps();
        int64_t j = 0;
        for (; j + 8 <= width; j += 8) {
            __m256 d[8];
            for (int k = 0; k < 8; k++) {
                int64_t i = (r + k) * width + j;
                d[k] = _mm256_andnot_ps(sign, _mm256_sub_ps(load8(dt, x, i), load8(dt, y, i)));
            }
            /* Transpose: c[m] holds column j + m of the 8 rows, lane k for row r + k. */
            __m256 t0 = _mm256_unpacklo_ps(d[0], d[1]), t1 = _mm256_unpackhi_ps(d[0], d[1]);
            __m256 t2 = _mm256_unpacklo_ps(d[2], d[3]), t3 = _mm256_unpackhi_ps(d[2], d[3]);
            __m256 t4 = _mm256_unpacklo_ps(d[4], d[5]), t5 = _mm256_unpackhi_ps(d[4], d[5]);
            __m256 t6 = _mm256_unpacklo_ps(d[6], d[7]), t7 = _mm256_unpackhi_ps(d[6], d[7]);
            __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
            __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
            __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
            __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
            __m256 c[8] = {
                _mm256_permute2f128_ps(s0, s4, 0x20), _mm256_permute2f128_ps(s1, s5, 0x20),
                _mm256_permute2f128_ps(s2, s6, 0x20), _mm256_permute2f128_ps(s3, s7, 0x20),
                _mm256_permute2f128_ps(s0, s4, 0x31), _mm256_permute2f128_ps(s1, s5, 0x31),
                _mm256_permute2f128_ps(s2, s6, 0x31), _mm256_permute2f128_ps(s3, s7, 0x31),
            };
            /* In column order: each lane's sum gets its row's values one at a time. */
            for (int m = 0; m < 8; m++) acc = _mm256_add_ps(acc, c[m]);
        }
        float a[8];
        _mm256_storeu_ps(a, acc);
        /* The last width % 8 columns, still in order, one at a time. */
        tail(dt, x, y, r, 8, width, j, a, out);
    }
    const float zero[8] = {0};
    tail(dt, x, y, r, (int)(rows - r), width, 0, zero, out);
}

/* 1 when the AVX2 path runs on this CPU (float16 is supported only then). */
int maec_l1_simd(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

/* 0 on success; -1 for a dtype the chosen path does not handle (the caller uses torch).
 * `simd` is maec_l1_simd()'s answer (or maec_simd_level()'s), asked once by the caller. */
int maec_l1_rows(int simd, int dt, const void *x, const void *y, int64_t rows,
                 int64_t width, float *out) {
    if (dt != DT_F32 && dt != DT_BF16 && dt != DT_F16) return -1;
    if (simd) {
        rows_avx2(dt, x, y, rows, width, out);
        return 0;
    }
    if (dt == DT_F16) return -1;
    rows_scalar(dt, x, y, rows, width, out);
    return 0;
}
