// The AVX-VNNI kernels built with vpdpbusd's EVEX form (AVX-512 VNNI + VL): the same instruction
// on the same 256-bit registers, so that an AVX-512 host without AVX-VNNI runs and tests the
// AVX-VNNI path (LOCALRUN_ISA=avxvnni); see qmatmul_simd.h and ops.cpp.
#include <type_traits>
#define ISA_NS avxvnni_evex
#define LOCALRUN_AVXVNNI 1
#include "qmatmul_simd.h"
