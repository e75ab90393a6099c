// ATen's vector types (at::vec::Vectorized) at the width the including kernel is compiled for.
//
// The kernels are compiled with the CPU's flags (executor/custom_ops/_build.py), but ATen's vector
// headers pick their width from CPU_CAPABILITY macros that only PyTorch's own build defines. This
// sets them from what the compiler targets: AVX-512 or AVX2, plain C++ loops elsewhere. Include it
// before any ATen header. Every kernel build has this directory on its include path, and its
// headers are part of the build key.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY AVX2
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
