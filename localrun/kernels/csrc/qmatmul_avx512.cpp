// The AVX-512 VNNI instance of the quantized matmul (vpdpbusd on 256-bit vectors); see qmatmul_simd.h.
#include <type_traits>
#define ISA_NS avx512
#define LOCALRUN_VNNI 1
#include "qmatmul_simd.h"
