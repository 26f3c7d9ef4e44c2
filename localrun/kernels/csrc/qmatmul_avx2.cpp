// The AVX2 instance of the quantized matmul (maddubs + madd); see qmatmul_simd.h.
#include <type_traits>
#define ISA_NS avx2
#include "qmatmul_simd.h"
