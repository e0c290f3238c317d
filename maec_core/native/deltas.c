/*
 * Task arithmetic, θ0 + λ·(Σ w_i (θ_i − θ0)) [/ Σ w_i], on a flat run of elements in one
 * pass, bit for bit what maec_core.methods.task_arithmetic computes with torch's CPU ops.
 *
 * torch runs each step as its own pass over the slice, and in 16 bits each pass also
 * converts every entry to float32 and back: six to eight passes where one suffices.
 * Here every entry goes through the same steps in the same order, with the same
 * roundings, in registers:
 *
 * - 16-bit compute: the inputs are rounded to the compute dtype, then each subtract, multiply, divide and
 *   add is done in float32 and rounded to the 16-bit type, as torch's CPU kernels do (a
 *   float32 result of two 16-bit operands rounded once is the correctly rounded 16-bit
 *   one). The weighted deltas are summed in float32 from +0.0 in order and rounded once,
 *   as torch's sum over the first axis of up to 16 stacked rows does.
 * - float32 compute: the same steps in float32 with no rounding between them, the sum
 *   in order from the first delta (the engine's in-place float32 sum).
 *
 * The result is rounded to the output dtype (round to nearest even, as torch's casts) and
 * stored; the return value says whether any stored entry is inf or NaN. The build turns
 * off floating-point contraction: a fused multiply-add would round once where torch
 * rounds twice.
 */
#include <stdint.h>
#include <string.h>
#include <immintrin.h>

enum { DT_F32 = 0, DT_BF16 = 1, DT_F16 = 2 };
/* The most deltas the 16-bit sum handles: torch's multi-row sum groups more. */
enum { MAX_DELTAS = 16 };

__attribute__((target("avx2,f16c")))
static inline __m256 ld8(int dt, const void *p, int64_t i) {
    if (dt == DT_F32) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (dt == DT_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* x rounded to bfloat16 (nearest, ties to even), held in float32; NaN stays NaN.
 * `any_nan`: x may be a NaN whose low 16 bits are not all zero, which the carry of the
 * rounding could turn into a finite value; such a NaN becomes a quiet NaN instead. Every
 * NaN of a merge of bfloat16 inputs has those bits zero (an input's, carried by the
 * arithmetic, or the default NaN an invalid operation makes), so that case skips it. */
__attribute__((target("avx2,f16c"), always_inline))
static inline __m256 round_bf16(__m256 x, int any_nan) {
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb);
    r = _mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u));
    if (!any_nan) return _mm256_castsi256_ps(r);
    __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_blendv_ps(_mm256_castsi256_ps(r),
                            _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000)), nan);
}

__attribute__((target("avx2,f16c")))
static inline __m256 round_f16(__m256 x) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
}

/* x rounded to `dt`; `any_nan` as for round_bf16 (1 unless the inputs are bfloat16). */
__attribute__((target("avx2,f16c"), always_inline))
static inline __m256 round_nan(int dt, __m256 x, int any_nan) {
    if (dt == DT_BF16) return round_bf16(x, any_nan);
    if (dt == DT_F16) return round_f16(x);
    return x;
}

#define round_to(dt, x) round_nan((dt), (x), a->in_dt != DT_BF16)

/* Store 8 values already rounded to `dt` (exact in it). */
__attribute__((target("avx2,f16c")))
static inline void st8(int dt, void *p, int64_t i, __m256 x) {
    if (dt == DT_F32) {
        _mm256_storeu_ps((float *)p + i, x);
        return;
    }
    __m128i h;
    if (dt == DT_F16) {
        h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    } else {
        __m256i u = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
        h = _mm_packus_epi32(_mm256_castsi256_si128(u), _mm256_extracti128_si256(u, 1));
    }
    _mm_storeu_si128((__m128i *)((uint16_t *)p + i), h);
}

typedef struct {
    int in_dt, c, out_dt, n;  /* input, compute and output dtypes */
    const float *w;   /* per delta; 1.0 skips the multiply, as torch's path does */
    int normalize;
    float divisor;
    int scale;
    float lambda;
} ta_args;

/* A call's per-delta and per-call constants, hoisted out of the element loop into locals:
 * read through the caller's pointers, the compiler would reload them after every store
 * to `out` (which, as far as it knows, may alias them). */
typedef struct {
    const void *m[MAX_DELTAS];
    __m256 w[MAX_DELTAS];
    int mul[MAX_DELTAS];  /* 0 where the weight is 1.0: torch's path skips that multiply */
    __m256 divisor, lambda;
    int normalize, scale;  /* a's, for the loops that are not given `a` */
} ta_consts;

/* q for the call `a` on `models`: every loop's setup. */
__attribute__((target("avx2,f16c"), always_inline))
static inline void ta_setup(ta_consts *q, const ta_args *a, const void *const *models) {
    for (int k = 0; k < a->n; k++) {
        q->m[k] = models[k];
        q->w[k] = _mm256_set1_ps(a->w[k]);
        q->mul[k] = a->w[k] != 1.0f;
    }
    q->divisor = _mm256_set1_ps(a->divisor);
    q->lambda = _mm256_set1_ps(a->lambda);
    q->normalize = a->normalize;
    q->scale = a->scale;
}

/* Half j of 16 entries from offset i, converted to float32. bfloat16 takes one unpack
 * (its bits are float32's upper half) instead of a widen and a shift; its halves then
 * hold entries 0-3 and 8-11, and 4-7 and 12-15, an order st16 undoes. Element-wise
 * steps do not care. */
__attribute__((target("avx2,f16c"), always_inline))
static inline __m256 ld_half(int dt, const void *p, int64_t i, int j) {
    if (dt != DT_BF16) return ld8(dt, p, i + 8 * j);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(j ? _mm256_unpackhi_epi16(_mm256_setzero_si256(), h)
                                 : _mm256_unpacklo_epi16(_mm256_setzero_si256(), h));
}

/* Store 16 values rounded to `dt` (see round_out), in ld_half's order for `in_dt`. From
 * bfloat16 to bfloat16 that order costs nothing: one shift per vector and one pack,
 * whose per-lane order is the unpacks'. */
__attribute__((target("avx2,f16c"), always_inline))
static inline void st16(int in_dt, int dt, void *p, int64_t i, const __m256 v[2]) {
    if (in_dt != DT_BF16) {
        st8(dt, p, i, v[0]);
        st8(dt, p, i + 8, v[1]);
    } else if (dt != DT_BF16) {
        st8(dt, p, i, _mm256_permute2f128_ps(v[0], v[1], 0x20));
        st8(dt, p, i + 8, _mm256_permute2f128_ps(v[0], v[1], 0x31));
    } else {
        __m256i lo = _mm256_srli_epi32(_mm256_castps_si256(v[0]), 16);
        __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(v[1]), 16);
        _mm256_storeu_si256((__m256i *)((uint16_t *)p + i), _mm256_packus_epi32(lo, hi));
    }
}

/* The last rounding, to the output dtype, for st16 and the finiteness test only: to
 * bfloat16 its upper 16 bits are the result and the low ones are left unmasked (the
 * store shifts them out; the exponent lies in the upper half). */
__attribute__((target("avx2,f16c"), always_inline))
static inline __m256 round_out(int dt, __m256 x, int any_nan) {
    if (dt != DT_BF16 || any_nan) return round_nan(dt, x, any_nan);
    __m256i u = _mm256_castps_si256(x);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    return _mm256_castsi256_ps(
        _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb));
}

/* Half j of 16 inputs converted to the compute dtype, as torch's copy into it rounds
 * them. */
__attribute__((target("avx2,f16c"), always_inline))
static inline __m256 ld(const ta_args *a, const void *p, int64_t i, int j) {
    __m256 x = ld_half(a->in_dt, p, i, j);
    return a->c == a->in_dt ? x : round_to(a->c, x);
}

/* All-ones when one of the first m stored entries at p is inf or NaN (the tail's test,
 * on what was stored: ld_half's order puts the padded lanes among the vectors' lanes). */
__attribute__((target("avx2,f16c")))
static inline __m256i tail_bad(int dt, const void *p, int64_t m) {
    int bad = 0;
    for (int64_t k = 0; k < m; k++) {
        if (dt == DT_F32) {
            uint32_t u;
            memcpy(&u, (const char *)p + 4 * k, 4);
            bad |= (u & 0x7f800000u) == 0x7f800000u;
        } else {
            uint16_t h;
            memcpy(&h, (const char *)p + 2 * k, 2);
            const uint16_t e = dt == DT_BF16 ? 0x7f80 : 0x7c00;
            bad |= (h & e) == e;
        }
    }
    return _mm256_set1_epi32(bad ? -1 : 0);
}

/* Delta k's term, x − b weighted, in the compute dtype; added to the sum s. */
__attribute__((target("avx2,f16c"), always_inline))
static inline __m256 ta_add(const ta_args *a, const ta_consts *q, int k, __m256 x, __m256 b,
                            __m256 s) {
    const int c = a->c;
    __m256 d = round_to(c, _mm256_sub_ps(x, b));
    if (q->mul[k]) d = round_to(c, _mm256_mul_ps(d, q->w[k]));
    /* 16-bit: the float32 sum from +0.0; float32: from the first delta. */
    return (k == 0 && c == DT_F32) ? d : _mm256_add_ps(s, d);
}

/* The sum's last steps: rounded, divided, scaled, added to the base, rounded to the
 * output dtype (see round_out). */
__attribute__((target("avx2,f16c"), always_inline))
static inline __m256 ta_end(const ta_args *a, const ta_consts *q, __m256 s, __m256 b) {
    const int c = a->c;
    s = round_to(c, s);
    if (a->normalize) s = round_to(c, _mm256_div_ps(s, q->divisor));
    if (a->scale) s = round_to(c, _mm256_mul_ps(s, q->lambda));
    s = _mm256_add_ps(s, b);
    /* Rounded to the compute dtype, then to the output's (once when they agree). */
    if (a->out_dt != c) s = round_to(c, s);
    return round_out(a->out_dt, s, a->in_dt != DT_BF16);
}

/* 16 entries from offset i; returns the all-ones lanes of non-finite results. 16-bit
 * compute runs one half after the other: its roundings' constants fill the registers
 * that a second chain would need. float32 compute, with few steps, runs both halves
 * side by side, each input loaded once. */
__attribute__((target("avx2,f16c"), always_inline))
static inline __m256i ta16(const ta_args *a, const ta_consts *q, const void *base, void *out,
                           int64_t i) {
    __m256 r[2];
    if (a->c == DT_F32) {
        __m256 b0 = ld(a, base, i, 0), b1 = ld(a, base, i, 1);
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
        for (int k = 0; k < a->n; k++) {
            s0 = ta_add(a, q, k, ld(a, q->m[k], i, 0), b0, s0);
            s1 = ta_add(a, q, k, ld(a, q->m[k], i, 1), b1, s1);
        }
        r[0] = ta_end(a, q, s0, b0);
        r[1] = ta_end(a, q, s1, b1);
    } else {
        for (int j = 0; j < 2; j++) {
            __m256 b = ld(a, base, i, j), s = _mm256_setzero_ps();
            for (int k = 0; k < a->n; k++) s = ta_add(a, q, k, ld(a, q->m[k], i, j), b, s);
            r[j] = ta_end(a, q, s, b);
        }
    }
    st16(a->in_dt, a->out_dt, out, i, r);
    __m256i e = _mm256_set1_epi32(0x7f800000);
    return _mm256_or_si256(
        _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(r[0]), e), e),
        _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(r[1]), e), e));
}

__attribute__((target("avx2,f16c"), always_inline))
static inline int ta_run(const ta_args *a, const void *base, const void *const *models,
                         void *out, int64_t n) {
    ta_consts q;
    ta_setup(&q, a, models);
    __m256i bad = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) bad = _mm256_or_si256(bad, ta16(a, &q, base, out, i));
    if (i < n) {
        /* The last n % 16 entries through zero-padded copies, so they take the same
         * steps; the padding's results are stored in the copy and not tested. */
        const int in_size = a->in_dt == DT_F32 ? 4 : 2, out_size = a->out_dt == DT_F32 ? 4 : 2;
        const int64_t m = n - i;
        unsigned char pb[64] = {0}, pm[MAX_DELTAS][64], po[64];
        memcpy(pb, (const char *)base + i * in_size, (size_t)(m * in_size));
        for (int k = 0; k < a->n; k++) {
            memset(pm[k], 0, sizeof pm[k]);
            memcpy(pm[k], (const char *)models[k] + i * in_size, (size_t)(m * in_size));
            q.m[k] = pm[k];
        }
        ta16(a, &q, pb, po, 0);
        memcpy((char *)out + i * out_size, po, (size_t)(m * out_size));
        bad = _mm256_or_si256(bad, tail_bad(a->out_dt, po, m));
    }
    return !_mm256_testz_si256(bad, bad);
}

/*
 * bfloat16 in, compute and out, what most published recipes ask for: its own loop. Every
 * rounding is the integer one of round_bf16 (5 operations), so this path is bound by the
 * count of operations, not by memory: both halves of 16 entries run side by side (the
 * constants stay in registers), the loop over the deltas is unrolled for the common
 * counts, and what is stored is tested for inf and NaN once per 16 packed entries (the
 * largest magnitude seen) instead of once per 8 float32 lanes.
 */
/* x rounded to bfloat16 (round_bf16 without the NaN guard: the inputs are bfloat16). */
#define RB16(x)                                                                           \
    _mm256_castsi256_ps(_mm256_and_si256(                                                 \
        _mm256_add_epi32(_mm256_add_epi32(_mm256_castps_si256(x), bias),                  \
                         _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 16),  \
                                          one)),                                          \
        hi16))

/* 16 entries from offset i, stored as bfloat16 at out + i; returns them packed. The
 * halves are ld_half's (entries 0-3 and 8-11, 4-7 and 12-15), which the pack undoes. */
__attribute__((target("avx2,f16c"), always_inline))
static inline __m256i ta_bf16_16(const ta_consts *q, const int n, const uint16_t *base,
                                 uint16_t *out, int64_t i) {
    const __m256i z = _mm256_setzero_si256(), one = _mm256_set1_epi32(1),
                  bias = _mm256_set1_epi32(0x7fff),
                  hi16 = _mm256_set1_epi32((int)0xffff0000u);
    __m256i h = _mm256_loadu_si256((const __m256i *)(base + i));
    const __m256 b0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h));
    const __m256 b1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h));
    /* The float32 sum from +0.0, in order, as torch's sum over the stacked deltas. */
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
#pragma GCC unroll 4
    for (int k = 0; k < n; k++) {
        h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)q->m[k] + i));
        __m256 d0 = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, h)), b0);
        __m256 d1 = _mm256_sub_ps(_mm256_castsi256_ps(_mm256_unpackhi_epi16(z, h)), b1);
        d0 = RB16(d0);
        d1 = RB16(d1);
        if (q->mul[k]) {
            d0 = _mm256_mul_ps(d0, q->w[k]);
            d1 = _mm256_mul_ps(d1, q->w[k]);
            d0 = RB16(d0);
            d1 = RB16(d1);
        }
        s0 = _mm256_add_ps(s0, d0);
        s1 = _mm256_add_ps(s1, d1);
    }
    s0 = RB16(s0);
    s1 = RB16(s1);
    if (q->normalize) {
        s0 = _mm256_div_ps(s0, q->divisor);
        s1 = _mm256_div_ps(s1, q->divisor);
        s0 = RB16(s0);
        s1 = RB16(s1);
    }
    if (q->scale) {
        s0 = _mm256_mul_ps(s0, q->lambda);
        s1 = _mm256_mul_ps(s1, q->lambda);
        s0 = RB16(s0);
        s1 = RB16(s1);
    }
    /* The last rounding, to the output: its upper 16 bits are the result (round_out). */
    __m256i u0 = _mm256_castps_si256(_mm256_add_ps(s0, b0));
    __m256i u1 = _mm256_castps_si256(_mm256_add_ps(s1, b1));
    u0 = _mm256_add_epi32(_mm256_add_epi32(u0, bias),
                          _mm256_and_si256(_mm256_srli_epi32(u0, 16), one));
    u1 = _mm256_add_epi32(_mm256_add_epi32(u1, bias),
                          _mm256_and_si256(_mm256_srli_epi32(u1, 16), one));
    const __m256i packed = _mm256_packus_epi32(_mm256_srli_epi32(u0, 16),
                                               _mm256_srli_epi32(u1, 16));
    _mm256_storeu_si256((__m256i *)(out + i), packed);
    return packed;
}

/* Whether a bfloat16 magnitude (sign cleared) at least this is inf or NaN. */
enum { BF16_INF = 0x7f80 };

__attribute__((target("avx2,f16c"), always_inline))
static inline int ta_bf16_loop(const ta_consts *q, const int n, const uint16_t *base,
                               uint16_t *out, int64_t count) {
    const __m256i abs = _mm256_set1_epi16(0x7fff);
    __m256i top = _mm256_setzero_si256();  /* the largest magnitude stored, per lane */
    int64_t i = 0;
    for (; i + 16 <= count; i += 16)
        top = _mm256_max_epu16(top, _mm256_and_si256(ta_bf16_16(q, n, base, out, i), abs));
    int bad = !_mm256_testz_si256(
        _mm256_cmpgt_epi16(top, _mm256_set1_epi16(BF16_INF - 1)),
        _mm256_set1_epi16(-1));
    if (i < count) {
        /* The last count % 16 entries through zero-padded copies, as ta_run does. */
        const int64_t m = count - i;
        uint16_t pb[16] = {0}, pm[MAX_DELTAS][16], po[16];
        ta_consts t = *q;
        memcpy(pb, base + i, (size_t)m * 2);
        for (int k = 0; k < n; k++) {
            memset(pm[k], 0, sizeof pm[k]);
            memcpy(pm[k], (const uint16_t *)q->m[k] + i, (size_t)m * 2);
            t.m[k] = pm[k];
        }
        ta_bf16_16(&t, n, pb, po, 0);
        memcpy(out + i, po, (size_t)m * 2);
        for (int64_t k = 0; k < m; k++) bad |= (po[k] & 0x7fff) >= BF16_INF;
    }
    return bad;
}

#define TA_BF16_N(N) case N: return ta_bf16_loop(&q, N, base, out, count);

__attribute__((target("avx2,f16c")))
static int ta_bf16(const ta_args *a, const void *base, const void *const *models, void *out,
                   int64_t count) {
    ta_consts q;
    ta_setup(&q, a, models);
    switch (a->n) {
        TA_BF16_N(1)
        TA_BF16_N(2)
        TA_BF16_N(3)
        TA_BF16_N(4)
        default: return ta_bf16_loop(&q, a->n, base, out, count);
    }
}

/*
 * AVX-512 (F and BW) loops for the two recipes from bfloat16 to bfloat16 that the engine
 * runs most, bfloat16 and float32 compute: the same steps, in the same order, with the
 * same roundings as ta_bf16 and ta_run, 32 entries a step in vectors of 16 float32.
 * bfloat16 compute is bound by its integer roundings; here each takes 4 operations on 16
 * lanes (a mask of the lowest kept bit, two adds, an and) where round_bf16 takes 5 on 8.
 * AVX512_BF16's conversion is not used: it flushes subnormals and rounds NaNs otherwise.
 *
 * 32 bfloat16 entries are 16 lanes of two: the even entries are the lanes shifted up 16
 * bits, the odd ones the lanes with their low 16 bits cleared, and the store puts the two
 * back with one shift and one bitwise select, so no shuffle either way. The tail (count
 * % 32) takes masked loads, zero past the end as ta_run's padded copies, and a masked
 * store; the masked-off lanes are neither stored nor tested.
 */
#define AVX512 __attribute__((target("avx512f,avx512bw,avx2,f16c")))
#define AVX512_INLINE __attribute__((target("avx512f,avx512bw,avx2,f16c"), always_inline))

/* x rounded to bfloat16 in its upper 16 bits, the low 16 left as they fall (round_out). */
AVX512_INLINE static inline __m512i rb16_high(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __mmask16 odd = _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x10000));
    /* + 0x7fff, + 0x8000 where the lowest kept bit is set: ties to even. */
    return _mm512_mask_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), odd, u,
                                 _mm512_set1_epi32(0x8000));
}

/* x rounded to the compute dtype `c` (round_bf16 without the NaN guard: bfloat16 inputs). */
AVX512_INLINE static inline __m512 rnd512(int c, __m512 x) {
    if (c != DT_BF16) return x;
    return _mm512_castsi512_ps(
        _mm512_and_si512(rb16_high(x), _mm512_set1_epi32((int)0xffff0000u)));
}

/* The even and odd entries of 32 bfloat16 at p as float32; zeros where `m` has no bit. */
AVX512_INLINE static inline void ld32(const uint16_t *p, __mmask32 m, __m512 v[2]) {
    const __m512i h = _mm512_maskz_loadu_epi16(m, p);
    v[0] = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
    v[1] = _mm512_castsi512_ps(_mm512_and_si512(h, _mm512_set1_epi32((int)0xffff0000u)));
}

/* A scalar of q's, as 16 lanes: read from memory as the operand's broadcast, where a
 * register's broadcast would cost a shuffle in the loop. */
AVX512_INLINE static inline __m512 wide(const __m256 *x) {
    return _mm512_set1_ps(((const float *)x)[0]);
}

/* 32 entries from offset i into out + i, where `m` has a bit, computed in `c`; returns
 * them packed (ld32's order undone). */
AVX512_INLINE static inline __m512i ta32(const ta_consts *q, const int c, const int n,
                                         const uint16_t *base, uint16_t *out, int64_t i,
                                         __mmask32 m) {
    __m512 b[2], x[2], s[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    ld32(base + i, m, b);
#pragma GCC unroll 4
    for (int k = 0; k < n; k++) {
        ld32((const uint16_t *)q->m[k] + i, m, x);
#pragma GCC unroll 2
        for (int j = 0; j < 2; j++) {
            __m512 d = rnd512(c, _mm512_sub_ps(x[j], b[j]));
            if (q->mul[k]) d = rnd512(c, _mm512_mul_ps(d, wide(&q->w[k])));
            /* 16-bit: the float32 sum from +0.0; float32: from the first delta (ta_add). */
            s[j] = (k == 0 && c == DT_F32) ? d : _mm512_add_ps(s[j], d);
        }
    }
    __m512i r[2];
#pragma GCC unroll 2
    for (int j = 0; j < 2; j++) {
        __m512 t = rnd512(c, s[j]);
        if (q->normalize) t = rnd512(c, _mm512_div_ps(t, wide(&q->divisor)));
        if (q->scale) t = rnd512(c, _mm512_mul_ps(t, wide(&q->lambda)));
        r[j] = rb16_high(_mm512_add_ps(t, b[j]));
    }
    /* Odd entries' upper halves where 0xffff0000 has bits, even ones' below. */
    const __m512i packed = _mm512_ternarylogic_epi32(
        _mm512_set1_epi32((int)0xffff0000u), r[1], _mm512_srli_epi32(r[0], 16), 0xca);
    _mm512_mask_storeu_epi16(out + i, m, packed);
    return packed;
}

/* Whether a stored entry is inf or NaN; the largest magnitude per lane as ta_bf16_loop. */
AVX512_INLINE static inline int ta512_loop(const ta_consts *q, const int c, const int n,
                                           const uint16_t *base, uint16_t *out,
                                           int64_t count) {
    const __m512i abs = _mm512_set1_epi16(0x7fff);
    __m512i top = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 32 <= count; i += 32)
        top = _mm512_max_epu16(
            top, _mm512_and_si512(ta32(q, c, n, base, out, i, (__mmask32)~0u), abs));
    if (i < count) {
        const __mmask32 m = (__mmask32)((1u << (count - i)) - 1);
        top = _mm512_mask_max_epu16(
            top, m, top, _mm512_and_si512(ta32(q, c, n, base, out, i, m), abs));
    }
    return _mm512_cmpgt_epu16_mask(top, _mm512_set1_epi16(BF16_INF - 1)) != 0;
}

/* One loop per count of models up to four (constants the compiler unrolls), for compute
 * dtype C. */
#define TA512_BY_COUNT(C)                                              \
    switch (a->n) {                                                    \
        case 1: return ta512_loop(&q, C, 1, base, out, count);         \
        case 2: return ta512_loop(&q, C, 2, base, out, count);         \
        case 3: return ta512_loop(&q, C, 3, base, out, count);         \
        case 4: return ta512_loop(&q, C, 4, base, out, count);         \
        default: return ta512_loop(&q, C, a->n, base, out, count);     \
    }

/* bfloat16 in and out, compute `c` bfloat16 or float32. */
AVX512 static int ta_avx512(const ta_args *a, const void *base, const void *const *models,
                            void *out, int64_t count) {
    ta_consts q;
    ta_setup(&q, a, models);
    if (a->c == DT_BF16) TA512_BY_COUNT(DT_BF16)
    TA512_BY_COUNT(DT_F32)
}

/* The common cases as their own loops, so the compiler drops the dtype branches. */
#define TA_CASE(IN, C, OUT)                                                         \
    if (a.in_dt == (IN) && a.c == (C) && a.out_dt == (OUT)) {                       \
        a.in_dt = (IN); a.c = (C); a.out_dt = (OUT);                                \
        return ta_run(&a, base, models, out, n);                                    \
    }

__attribute__((target("avx2,f16c")))
static int ta_avx2(ta_args a, const void *base, const void *const *models, void *out,
                   int64_t n) {
    if (a.in_dt == DT_BF16 && a.c == DT_BF16 && a.out_dt == DT_BF16)
        return ta_bf16(&a, base, models, out, n);
    TA_CASE(DT_BF16, DT_F32, DT_BF16)
    TA_CASE(DT_F16, DT_F16, DT_F16)
    TA_CASE(DT_F16, DT_F32, DT_F16)
    return ta_run(&a, base, models, out, n);
}

int maec_l1_simd(void);

/* 2 where the CPU also has AVX-512 F and BW (the wider task-arithmetic loops), else
 * maec_l1_simd()'s answer: 1 with AVX2 and F16C, 0 without. */
int maec_simd_level(void) {
    if (!maec_l1_simd()) return 0;
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? 2 : 1;
}

/*
 * 1 when an entry of the result is inf or NaN, 0 when all are finite, -1 when this path
 * cannot take the call (no AVX2/F16C on this CPU, an unknown dtype, too many deltas): the
 * caller then uses torch.
 * `simd` is maec_simd_level()'s answer, or less to leave its wider loops unused (1: AVX2
 * only). `weights` holds n values, already in the compute dtype; `divisor` and `lambda`
 * are used when `normalize` and `scale` are set.
 */
int maec_task_arithmetic(int simd, int in_dt, int c_dt, int out_dt, int n,
                         const void *base, const void *const *models, const float *weights,
                         int normalize, float divisor, int scale, float lambda, void *out,
                         int64_t count) {
    if (!simd || n < 1 || n > MAX_DELTAS) return -1;
    if (in_dt < DT_F32 || in_dt > DT_F16 || c_dt < DT_F32 || c_dt > DT_F16
        || out_dt < DT_F32 || out_dt > DT_F16) return -1;
    ta_args a = {in_dt, c_dt, out_dt, n, weights, normalize, divisor, scale, lambda};
    if (simd >= 2 && in_dt == DT_BF16 && out_dt == DT_BF16 && c_dt != DT_F16)
        return ta_avx512(&a, base, models, out, count);
    return ta_avx2(a, base, models, out, count);
}

/*
 * Linear averaging, (Σ w_i x_i) / total, as maec_core.methods.linear computes it with
 * torch: the products accumulated in float32 from +0.0 in order, the sum divided by
 * `total` when `normalize`, rounded to the compute dtype, then to the output dtype. The
 * inputs are first rounded to the compute dtype. torch's addcmul runs each product and
 * its add as one fused multiply-add where its build for this CPU does (`fma`; the caller
 * asks torch once), else as two roundings. Same answers as maec_task_arithmetic.
 */
typedef struct {
    int in_dt, c, out_dt, n;
    const float *w;
    int normalize;
    float total;
    int fma;  /* whether torch's addcmul fuses the multiply and the add on this machine */
} lin_args;

__attribute__((target("avx2,f16c,fma"), always_inline))
static inline __m256i lin8(const lin_args *a, const void *const *xs, void *out, int64_t i) {
    __m256 s = _mm256_setzero_ps();
    for (int k = 0; k < a->n; k++) {
        __m256 x = ld8(a->in_dt, xs[k], i);
        if (a->c != a->in_dt) x = round_to(a->c, x);
        __m256 w = _mm256_set1_ps(a->w[k]);
        s = a->fma ? _mm256_fmadd_ps(x, w, s) : _mm256_add_ps(s, _mm256_mul_ps(x, w));
    }
    if (a->normalize) s = _mm256_div_ps(s, _mm256_set1_ps(a->total));
    __m256 r = round_to(a->c, s);
    if (a->out_dt != a->c) r = round_to(a->out_dt, r);
    st8(a->out_dt, out, i, r);
    __m256i e = _mm256_set1_epi32(0x7f800000);
    return _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_castps_si256(r), e), e);
}

__attribute__((target("avx2,f16c,fma"), always_inline))
static inline int lin_run(const lin_args *a, const void *const *xs, void *out, int64_t n) {
    __m256i bad = _mm256_setzero_si256();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) bad = _mm256_or_si256(bad, lin8(a, xs, out, i));
    if (i < n) {
        const int in_size = a->in_dt == DT_F32 ? 4 : 2, out_size = a->out_dt == DT_F32 ? 4 : 2;
        const int64_t m = n - i;
        unsigned char px[MAX_DELTAS + 1][32], po[32];
        const void *pxs[MAX_DELTAS + 1];
        for (int k = 0; k < a->n; k++) {
            memset(px[k], 0, sizeof px[k]);
            memcpy(px[k], (const char *)xs[k] + i * in_size, (size_t)(m * in_size));
            pxs[k] = px[k];
        }
        __m256i e = lin8(a, pxs, po, 0);
        memcpy((char *)out + i * out_size, po, (size_t)(m * out_size));
        int32_t lanes[8];
        _mm256_storeu_si256((__m256i *)lanes, e);
        for (int64_t k = 0; k < m; k++) bad = _mm256_or_si256(bad, _mm256_set1_epi32(lanes[k]));
    }
    return !_mm256_testz_si256(bad, bad);
}

#define LIN_CASE(IN, C, OUT)                                                        \
    if (a.in_dt == (IN) && a.c == (C) && a.out_dt == (OUT)) {                       \
        a.in_dt = (IN); a.c = (C); a.out_dt = (OUT);                                \
        return lin_run(&a, xs, out, n);                                             \
    }

__attribute__((target("avx2,f16c,fma")))
static int lin_avx2(lin_args a, const void *const *xs, void *out, int64_t n) {
    LIN_CASE(DT_BF16, DT_BF16, DT_BF16)
    LIN_CASE(DT_BF16, DT_F32, DT_BF16)
    LIN_CASE(DT_F16, DT_F16, DT_F16)
    LIN_CASE(DT_F16, DT_F32, DT_F16)
    return lin_run(&a, xs, out, n);
}

/* As maec_task_arithmetic: 1 when a result is inf or NaN, 0 if none, -1 declined. At most
 * MAX_DELTAS + 1 inputs. */
int maec_linear(int simd, int in_dt, int c_dt, int out_dt, int n, const void *const *xs,
                const float *weights, int normalize, float total, int fma, void *out,
                int64_t count) {
    if (!simd || n < 1 || n > MAX_DELTAS + 1) return -1;
    if (fma && !__builtin_cpu_supports("fma")) return -1;
    if (in_dt < DT_F32 || in_dt > DT_F16 || c_dt < DT_F32 || c_dt > DT_F16
        || out_dt < DT_F32 || out_dt > DT_F16) return -1;
    lin_args a = {in_dt, c_dt, out_dt, n, weights, normalize, total, fma ? 1 : 0};
    return lin_avx2(a, xs, out, count);
}
