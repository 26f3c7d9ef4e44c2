// The AVX-VNNI instance of the quantized matmul: the AVX2 kernels with vpdpbusd (VEX) for
// maddubs + madd, for Intel client cores from Alder Lake on (AVX-VNNI, no AVX-512); see qmatmul_simd.h.
#include <type_traits>
#define ISA_NS avxvnni
#ifndef LOCALRUN_AVXVNNI_AS_AVX2     // build.py sets it where the compiler has no -mavxvnni (GCC < 11)
#define LOCALRUN_AVXVNNI 1
#endif
#include "qmatmul_simd.h"
