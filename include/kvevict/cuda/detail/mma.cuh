// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_MMA_CUH
#define KVEVICT_CUDA_DETAIL_MMA_CUH

// The one tensor-core instruction the kernels use, behind one device function: the warp-wide
// D (16x8, float32) += A (16x16) * B (16x8) of 16-bit operands (bf16 or fp16), PTX's
// mma.sync.aligned.m16n8k16.row.col.f32. Three implementations with one contract:
//   - sm_80 and later: the PTX instruction;
//   - older architectures: a portable version from warp shuffles (32 per call: correct, slow);
//   - KVEVICT_CUDA_SIMULATOR: the simulator's warp collective (tests/cuda_sim), since a host
//     compiler cannot run PTX.
// The portable version and the simulator add the exact float32 products to D in ascending k,
// so they agree bit for bit (tested in the simulator); the hardware's adder rounds the sum
// its own way, so kernels built on this agree with the CPU to float32 rounding of the sums.
//
// Fragment layouts, PTX ISA "Matrix Fragments for mma.m16n8k16" (g = lane / 4, t = lane % 4;
// each 32-bit register holds two 16-bit elements, the lower k in the low half):
//   a[0] = A[g][2t, 2t+1]   a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]
//   d[0] = D[g][2t]  d[1] = D[g][2t+1]  d[2] = D[g+8][2t]  d[3] = D[g+8][2t+1]
// All 32 lanes of the warp must call it together (mma.sync.aligned).

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/dtype.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// Whether T is an operand type of the tensor-core MMA (bf16 or fp16).
template <class T>
struct is_mma_operand : std::integral_constant<bool, std::is_same<T, bf16>::value || std::is_same<T, fp16>::value> {};

template <class T>
__device__ __forceinline__ float mma_half_to_float(std::uint32_t bits) {
  const auto h = static_cast<std::uint16_t>(bits);
  return std::is_same<T, bf16>::value ? kvevict::detail::bf16_bits_to_float(h) : kvevict::detail::fp16_bits_to_float(h);
}

/// The contract of mma_m16n8k16 from warp shuffles, for GPUs without the instruction.
template <class T>
__device__ __forceinline__ void mma_m16n8k16_portable(float (&d)[4], const std::uint32_t (&a)[4],
                                                      const std::uint32_t (&b)[2]) {
  static_assert(is_mma_operand<T>::value, "mma operands are bf16 or fp16");
  const unsigned linear = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const int lane = static_cast<int>(linear % 32u), g = lane / 4, t = lane % 4;
  constexpr unsigned all_lanes = 0xffffffffu;
  for (int half = 0; half < 2; ++half) {  // k in [0, 8), then [8, 16): ascending
    for (int tt = 0; tt < 4; ++tt) {
      const std::uint32_t row_lo = __shfl_sync(all_lanes, a[2 * half], 4 * g + tt);
      const std::uint32_t row_hi = __shfl_sync(all_lanes, a[2 * half + 1], 4 * g + tt);
      const std::uint32_t col0 = __shfl_sync(all_lanes, b[half], 4 * (2 * t) + tt);
      const std::uint32_t col1 = __shfl_sync(all_lanes, b[half], 4 * (2 * t + 1) + tt);
      for (int h = 0; h < 2; ++h) {
        const float alo = mma_half_to_float<T>(row_lo >> (16 * h)), ahi = mma_half_to_float<T>(row_hi >> (16 * h));
        const float b0 = mma_half_to_float<T>(col0 >> (16 * h)), b1 = mma_half_to_float<T>(col1 >> (16 * h));
        // Products of 16-bit values are exact in float32: a fused multiply-add rounds the same.
        d[0] = fmaf(alo, b0, d[0]);
        d[1] = fmaf(alo, b1, d[1]);
        d[2] = fmaf(ahi, b0, d[2]);
        d[3] = fmaf(ahi, b1, d[3]);
      }
    }
  }
}

/// d += A * B on the tensor cores (layouts above). T: bf16 or fp16.
template <class T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  static_assert(is_mma_operand<T>::value, "mma operands are bf16 or fp16");
#if defined(KVEVICT_CUDA_SIMULATOR)
  cudasim::mma_m16n8k16(std::is_same<T, bf16>::value ? cudasim::mma_operands::bf16 : cudasim::mma_operands::f16, d, a,
                        b);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if (std::is_same<T, bf16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
#else
  mma_m16n8k16_portable<T>(d, a, b);
#endif
}

}  // namespace detail
}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DETAIL_MMA_CUH
