// float8 e4m3fn codes widened to float32, exactly, 8 (AVX2) or 16 (AVX-512) at a time: the
// decode kernel's scratch and in-place readers (paged_attention.cpp) and the prompt kernels'
// packers (prompt_attention.cpp) share them. e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa
// bits; a normal code's bits move into a float's place with the exponent rebiased (+120), a
// subnormal one (exponent 0) is mantissa x 2^-9, 0x7f/0xff are NaN (the stores never write them:
// they scale values to at most 448; a poisoned pool is NaN throughout).
#pragma once
#include <cmath>
#include <cstdint>
#include <immintrin.h>

namespace localrun {

__attribute__((target("avx2"))) inline __m256 fp8x8(const uint8_t* p) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m256i low7 = _mm256_set1_epi32(0x7f), em = _mm256_and_si256(x, low7);
    const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(em, 20), _mm256_set1_epi32(120 << 23)));
    const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(x, _mm256_set1_epi32(7))), _mm256_set1_ps(0x1p-9f));
    const __m256 is_sub = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x78)), _mm256_setzero_si256()));
    __m256 v = _mm256_blendv_ps(normal, sub, is_sub);
    v = _mm256_blendv_ps(v, _mm256_set1_ps(NAN), _mm256_castsi256_ps(_mm256_cmpeq_epi32(em, low7)));
    return _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x80)), 24)));
}

__attribute__((target("avx512f"))) inline __m512 fp8x16(const uint8_t* p) {
    const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m512i em = _mm512_and_si512(x, _mm512_set1_epi32(0x7f));
    const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(em, 20), _mm512_set1_epi32(120 << 23)));
    const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(7))), _mm512_set1_ps(0x1p-9f));
    __m512 v = _mm512_mask_blend_ps(_mm512_testn_epi32_mask(x, _mm512_set1_epi32(0x78)), normal, sub);
    v = _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(em, _mm512_set1_epi32(0x7f)), v, _mm512_set1_ps(NAN));
    return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24)));
}

}  // namespace localrun
