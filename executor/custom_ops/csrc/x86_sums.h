// Horizontal sums shared by the AVX-512 loops that end in one sum per output (gemv.cpp's dot_linear
// tiles, decode_attention.cpp's bf16 scores): four vectors' sums in one go, ~3.5 instructions a sum
// where a sum of one vector at a time takes ~8.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

namespace cann {

// Lanes 0-3: the sums of the lanes of a[0..R) (a[r] for r >= R counts as zero). AVX-512F only, so
// it inlines into any AVX-512 loop whatever else that loop's target adds.
template <int R = 4>
__attribute__((target("avx512f"))) inline __m128 sums_of_4(const __m512* a) {
  const __m512 z = _mm512_setzero_ps();
  const __m512 a0 = a[0], a1 = R > 1 ? a[1] : z, a2 = R > 2 ? a[2] : z, a3 = R > 3 ? a[3] : z;
  // 128-bit blocks: [a0 lo half, a0 hi half, a1 lo, a1 hi] summed pairwise, the same for a2, a3
  const __m512 t01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, 0x44), _mm512_shuffle_f32x4(a0, a1, 0xEE));
  const __m512 t23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, 0x44), _mm512_shuffle_f32x4(a2, a3, 0xEE));
  // block r: four partial sums of a[r]
  __m512 u = _mm512_add_ps(_mm512_shuffle_f32x4(t01, t23, 0x88), _mm512_shuffle_f32x4(t01, t23, 0xDD));
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0x4E));
  u = _mm512_add_ps(u, _mm512_permute_ps(u, 0xB1));
  const __m512i firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, u));
}

}  // namespace cann
#endif
