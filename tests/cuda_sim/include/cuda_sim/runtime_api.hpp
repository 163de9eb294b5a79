// The CUDA runtime API functions the simulator implements (src/runtime.cpp), with CUDA's
// signatures. "Device" memory is host memory the simulator allocates and registers, so
// cudaPointerGetAttributes answers truthfully and cudaMemcpy checks its direction and
// bounds; streams are synchronous queues (work runs when enqueued) that can also record a
// graph (cudaStreamBeginCapture ... cudaGraphLaunch).
#pragma once

#include <cstddef>

#include "cuda_sim/types.hpp"

// ---- errors and devices ------------------------------------------------------------------
cudaError_t cudaGetLastError() noexcept;
cudaError_t cudaPeekAtLastError() noexcept;
const char* cudaGetErrorName(cudaError_t err) noexcept;
const char* cudaGetErrorString(cudaError_t err) noexcept;
cudaError_t cudaGetDeviceCount(int* count) noexcept;
cudaError_t cudaGetDevice(int* device) noexcept;
cudaError_t cudaSetDevice(int device) noexcept;
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) noexcept;
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) noexcept;
cudaError_t cudaDeviceSynchronize() noexcept;

// ---- memory ------------------------------------------------------------------------------
cudaError_t cudaMalloc(void** ptr, std::size_t bytes) noexcept;
cudaError_t cudaMallocManaged(void** ptr, std::size_t bytes, unsigned flags = cudaMemAttachGlobal) noexcept;
cudaError_t cudaMallocHost(void** ptr, std::size_t bytes) noexcept;
cudaError_t cudaHostAlloc(void** ptr, std::size_t bytes, unsigned flags) noexcept;
cudaError_t cudaFree(void* ptr) noexcept;
cudaError_t cudaFreeHost(void* ptr) noexcept;
cudaError_t cudaHostRegister(void* ptr, std::size_t bytes, unsigned flags) noexcept;
cudaError_t cudaHostUnregister(void* ptr) noexcept;
cudaError_t cudaHostGetDevicePointer(void** device_ptr, void* host_ptr, unsigned flags) noexcept;
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* ptr) noexcept;
cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) noexcept;
cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr) noexcept;
cudaError_t cudaMemset(void* ptr, int value, std::size_t bytes) noexcept;
cudaError_t cudaMemsetAsync(void* ptr, int value, std::size_t bytes, cudaStream_t stream = nullptr) noexcept;

template <class T>
cudaError_t cudaMalloc(T** ptr, std::size_t bytes) noexcept {
  return cudaMalloc(reinterpret_cast<void**>(ptr), bytes);
}
template <class T>
cudaError_t cudaMallocManaged(T** ptr, std::size_t bytes, unsigned flags = cudaMemAttachGlobal) noexcept {
  return cudaMallocManaged(reinterpret_cast<void**>(ptr), bytes, flags);
}
template <class T>
cudaError_t cudaMallocHost(T** ptr, std::size_t bytes) noexcept {
  return cudaMallocHost(reinterpret_cast<void**>(ptr), bytes);
}

// ---- streams, events, graphs -------------------------------------------------------------
cudaError_t cudaStreamCreate(cudaStream_t* stream) noexcept;
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags) noexcept;
cudaError_t cudaStreamDestroy(cudaStream_t stream) noexcept;
cudaError_t cudaStreamSynchronize(cudaStream_t stream) noexcept;
cudaError_t cudaStreamQuery(cudaStream_t stream) noexcept;
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned flags = 0) noexcept;
cudaError_t cudaEventCreate(cudaEvent_t* event) noexcept;
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned flags) noexcept;
cudaError_t cudaEventDestroy(cudaEvent_t event) noexcept;
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr) noexcept;
cudaError_t cudaEventSynchronize(cudaEvent_t event) noexcept;
cudaError_t cudaEventQuery(cudaEvent_t event) noexcept;
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) noexcept;
cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) noexcept;
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) noexcept;
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) noexcept;
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long flags = 0) noexcept;
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) noexcept;
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) noexcept;
cudaError_t cudaGraphDestroy(cudaGraph_t graph) noexcept;

// ---- kernels -----------------------------------------------------------------------------
namespace cudasim {
namespace detail {
cudaError_t func_set_attribute(const void* kernel, cudaFuncAttribute attr, int value) noexcept;
cudaError_t func_get_attributes(cudaFuncAttributes* attr, const void* kernel) noexcept;
}  // namespace detail
}  // namespace cudasim

template <class T>
cudaError_t cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attr, int value) noexcept {
  return cudasim::detail::func_set_attribute(reinterpret_cast<const void*>(kernel), attr, value);
}
template <class T>
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, T* kernel) noexcept {
  return cudasim::detail::func_get_attributes(attr, reinterpret_cast<const void*>(kernel));
}
