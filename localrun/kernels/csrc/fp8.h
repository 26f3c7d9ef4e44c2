// float8 e4m3fn codes widened to float32, exactly, 8 (AVX2) or 16 (AVX-512) at a time: the
// decode kernel's scratch and in-place readers (paged_attention.cpp) and the prompt kernels'
// packers (prompt_attention.cpp) share them.
//
// e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits. Moved into a float16 pattern (the
// sign to bit 15, the other 7 bits to bits 7..13), a code is its value x 2^-8 exactly: the
// exponent bias 7 sits 8 below float16's 15, and e4m3's subnormals (exponent 0, mantissa x 2^-9)
// land on float16's subnormals the same way. vcvtph2ps widens that exactly and x 256 (exact)
// restores the value, in 16-bit integer steps where moving the bits into a float32's place took
// 32-bit ones and a second path for the subnormals. 0x7f / 0xff are NaN in e4m3fn and +-480 that
// way, a value no other code has, so they are caught after (the stores never write them: they
// scale values to at most 448; a poisoned pool is NaN throughout).
#pragma once
#include <cmath>
#include <cstdint>
#include <immintrin.h>

namespace localrun {

__attribute__((target("avx2,f16c"))) inline __m256 fp8x8(const uint8_t* p) {
    const __m128i w = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    const __m128i h = _mm_or_si128(_mm_and_si128(_mm_slli_epi16(w, 8), _mm_set1_epi16((short)0x8000)),
                                   _mm_and_si128(_mm_slli_epi16(w, 7), _mm_set1_epi16(0x3f80)));
    const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
    const __m256 nan = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.f), v), _mm256_set1_ps(480.f), _CMP_EQ_OQ);
    return _mm256_blendv_ps(v, _mm256_set1_ps(NAN), nan);
}

__attribute__((target("avx512f"))) inline __m512 fp8x16(const uint8_t* p) {
    const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m256i h = _mm256_or_si256(_mm256_and_si256(_mm256_slli_epi16(w, 8), _mm256_set1_epi16((short)0x8000)),
                                      _mm256_and_si256(_mm256_slli_epi16(w, 7), _mm256_set1_epi16(0x3f80)));
    const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
    const __mmask16 nan = _mm512_cmp_ps_mask(_mm512_abs_ps(v), _mm512_set1_ps(480.f), _CMP_EQ_OQ);
    return _mm512_mask_blend_ps(nan, v, _mm512_set1_ps(NAN));
}

}  // namespace localrun
