// "cuda" backend of swap_blocks_batch (contract: csrc/kv_offload/ops.h; design,
// status and device checks: docs/cuda_backend.md).
//
// One call is one job. It is enqueued on the current stream of the device
// that holds the device side of fragment 0, and the call returns once the
// copies are enqueued. Fragment 0 is inspected once (cudaPointerGetAttributes)
// and every later fragment is assumed to live in the same kinds of memory.
// Each job is copied one of two ways:
//
//   kernel  A copy kernel of kKernelCtas CTAs that reads and writes host
//           memory directly through UVA (page-locked host memory mapped at the
//           same address on the device, e.g. torch's pin_memory=True). The
//           region table goes to the device through a pinned staging buffer
//           on the same stream. Fast for small fragments, but uses SMs.
//   dma     The copy engines: one cudaMemcpyBatchAsync per job (CUDA >= 12.8,
//           not on the legacy default stream, not with pageable host memory),
//           otherwise one cudaMemcpyAsync per copy. The batch API's host
//           arrays are built in a CPU tensor the op returns (its workspace,
//           ops.h): the CUDA documentation does not say that they have been
//           read when the call returns, so the caller keeps them until the
//           copies have completed.
//
// By default a job whose mean copy is smaller than kKernelMaxMeanBytes uses
// the kernel, when one side of fragment 0 is host memory and both sides are
// device-accessible; everything else uses dma.
// VLLM_ASCEND_CUDA_COPY_METHOD=auto|kernel|dma overrides the choice ("kernel"
// still falls back to dma for memory the kernel cannot reach, such as pageable
// host memory).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "host_arrays.h"
#include "ops.h"

namespace vllm_ascend::kv_offload {
namespace {

// Auto mode: jobs with a smaller mean copy use the kernel. The threshold comes
// from a separate H200 copy benchmark (shared/tools/copybench.cu, figures in
// docs/cuda_backend.md), not from this backend, which has not run on a GPU:
// there the batch API reached 22 / 36 / 47-50 / 53 GB/s at 16 KiB / 64 KiB /
// 256 KiB / 1 MiB, a 16-CTA UVA kernel ~52 GB/s at every size; from 256 KiB on
// the DMA engines were as fast and leave the SMs to the model.
constexpr uint64_t kKernelMaxMeanBytes = uint64_t{256} << 10;
constexpr int kKernelCtas = 16;
constexpr int kKernelThreads = 512;
// Copies are split into work items of at most this many bytes, so that one
// huge merged copy is spread over all CTAs instead of stalling one.
constexpr uint64_t kKernelItemBytes = uint64_t{64} << 10;
// Staging buffers for region tables: a job takes a free slot (its event has
// completed), or adds a slot, or, when all kStagingSlots are in flight, waits
// for the oldest.
constexpr size_t kStagingSlots = 8;
constexpr size_t kMinStagingBytes = size_t{64} << 10;

constexpr const char* kOp = "swap_blocks_batch(device='cuda')";
constexpr const char* kMethodEnv = "VLLM_ASCEND_CUDA_COPY_METHOD";

// ---------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------

// A failed runtime call also sets the runtime's per-thread "last error";
// clear it so that the next torch launch check does not report it as its own.
[[noreturn]] void fail(cudaError_t err, const char* call,
                       const std::string& context) {
  (void)cudaGetLastError();
  TORCH_CHECK(false, kOp, ": ", call, " failed", context, ": ",
              cudaGetErrorName(err), " (", cudaGetErrorString(err), ")");
}

std::string job_context(size_t copies) {
  return c10::str(" (job of ", copies, " copies)");
}

std::string fragment_context(const CopyRegion& r) {
  return c10::str(" for fragment ", r.first_fragment, " (src_addrs=", r.src,
                  ", dst_addrs=", r.dst, ", bytes=", r.size, ")");
}

void check(cudaError_t err, const char* call, const std::string& context) {
  if (err != cudaSuccess) fail(err, call, context);
}

// ---------------------------------------------------------------------------
// Copy kernel
// ---------------------------------------------------------------------------

// One work item of the kernel: at most kKernelItemBytes bytes.
struct KernelItem {
  uint64_t src;
  uint64_t dst;
  uint64_t size;
};

// The CTA copies the largest prefix of `item` that is a whole number of T;
// returns its length in bytes. Each thread keeps kUnroll loads in flight.
template <typename T>
__device__ uint64_t copy_vectors(const KernelItem& item) {
  constexpr int kUnroll = 4;
  const T* __restrict__ src = reinterpret_cast<const T*>(item.src);
  T* __restrict__ dst = reinterpret_cast<T*>(item.dst);
  const uint64_t n = item.size / sizeof(T);
  const uint64_t stride = blockDim.x;
  uint64_t i = threadIdx.x;
  for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride) {
    T v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = src[i + u * stride];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) dst[i + u * stride] = v[u];
  }
  for (; i < n; i += stride) dst[i] = src[i];
  return n * sizeof(T);
}

// CTA b copies items b, b + gridDim.x, ... with the widest access (16, 8, 4,
// 2 or 1 bytes) that both addresses are aligned to; a tail shorter than that
// width is copied byte by byte.
__global__ void __launch_bounds__(kKernelThreads)
    copy_items_kernel(const KernelItem* __restrict__ items, uint64_t count) {
  for (uint64_t k = blockIdx.x; k < count; k += gridDim.x) {
    const KernelItem item = items[k];
    const uint64_t align = item.src | item.dst;
    uint64_t done;
    if (align % 16 == 0) {
      done = copy_vectors<uint4>(item);
    } else if (align % 8 == 0) {
      done = copy_vectors<uint2>(item);
    } else if (align % 4 == 0) {
      done = copy_vectors<uint32_t>(item);
    } else if (align % 2 == 0) {
      done = copy_vectors<uint16_t>(item);
    } else {
      done = copy_vectors<uint8_t>(item);
    }
    const auto* src = reinterpret_cast<const uint8_t*>(item.src);
    auto* dst = reinterpret_cast<uint8_t*>(item.dst);
    for (uint64_t i = done + threadIdx.x; i < item.size; i += blockDim.x) {
      dst[i] = src[i];
    }
  }
}

uint64_t count_items(const std::vector<CopyRegion>& regions) {
  uint64_t count = 0;
  for (const CopyRegion& r : regions) {
    count += (r.size + kKernelItemBytes - 1) / kKernelItemBytes;
  }
  return count;
}

// Writes the kernel's work items for `regions` to `out` (count_items long).
void fill_items(const std::vector<CopyRegion>& regions, KernelItem* out) {
  for (const CopyRegion& r : regions) {
    for (uint64_t off = 0; off < r.size; off += kKernelItemBytes) {
      *out++ = {r.src + off, r.dst + off,
                std::min(kKernelItemBytes, r.size - off)};
    }
  }
}

// One staging slot: a pinned host buffer, a device buffer of the same size
// and an event recorded after the last kernel that read them.
struct StagingSlot {
  void* host = nullptr;    // cudaHostAlloc
  void* device = nullptr;  // torch's CUDA caching allocator
  size_t capacity = 0;
  cudaEvent_t done = nullptr;
};

// Slots of one device. Not thread-safe: used under g_staging_mutex.
class StagingRing {
 public:
  // A slot of at least `bytes` whose previous kernel has finished.
  StagingSlot& acquire(size_t bytes, size_t copies) {
    for (size_t k = 0; k < slots_.size(); ++k) {
      const size_t idx = (next_ + k) % slots_.size();
      const cudaError_t state = cudaEventQuery(slots_[idx].done);
      if (state == cudaSuccess) return take(idx, bytes, copies);
      if (state != cudaErrorNotReady) {
        fail(state, "cudaEventQuery (staging slot)", job_context(copies));
      }
      (void)cudaGetLastError();  // "not ready" is no error
    }
    if (slots_.size() < kStagingSlots) {
      StagingSlot slot;
      check(cudaEventCreateWithFlags(&slot.done, cudaEventDisableTiming),
            "cudaEventCreateWithFlags (staging slot)", job_context(copies));
      slots_.push_back(slot);
      return take(slots_.size() - 1, bytes, copies);
    }
    const size_t idx = next_ % slots_.size();
    check(cudaEventSynchronize(slots_[idx].done),
          "cudaEventSynchronize (staging slot)", job_context(copies));
    return take(idx, bytes, copies);
  }

 private:
  StagingSlot& take(size_t idx, size_t bytes, size_t copies) {
    next_ = idx + 1;
    StagingSlot& slot = slots_[idx];
    if (slot.capacity >= bytes) return slot;
    // The slot is idle (its event completed), so its buffers can go.
    slot.capacity = 0;
    if (slot.device != nullptr) {
      c10::cuda::CUDACachingAllocator::raw_delete(slot.device);
      slot.device = nullptr;
    }
    if (slot.host != nullptr) {
      const cudaError_t err = cudaFreeHost(slot.host);
      slot.host = nullptr;
      check(err, "cudaFreeHost (staging slot)", job_context(copies));
    }
    size_t capacity = kMinStagingBytes;
    while (capacity < bytes) capacity *= 2;
    slot.device = c10::cuda::CUDACachingAllocator::raw_alloc(capacity);
    check(cudaHostAlloc(&slot.host, capacity, cudaHostAllocDefault),
          "cudaHostAlloc (staging slot)", job_context(copies));
    slot.capacity = capacity;
    return slot;
  }

  std::vector<StagingSlot> slots_;
  size_t next_ = 0;
};

std::mutex g_staging_mutex;

// Enqueues the copy kernel for `regions` on `stream` (of the current device).
void copy_with_kernel(const std::vector<CopyRegion>& regions,
                      cudaStream_t stream, c10::DeviceIndex device) {
  const uint64_t count = count_items(regions);
  const size_t bytes = count * sizeof(KernelItem);
  const int ctas = static_cast<int>(std::min<uint64_t>(kKernelCtas, count));

  std::lock_guard<std::mutex> lock(g_staging_mutex);
  // Never destroyed: freeing CUDA memory at process exit can fail.
  static auto* rings = new std::vector<StagingRing>();
  if (rings->size() <= static_cast<size_t>(device)) rings->resize(device + 1);
  StagingSlot& slot = (*rings)[device].acquire(bytes, regions.size());

  fill_items(regions, static_cast<KernelItem*>(slot.host));
  check(cudaMemcpyAsync(slot.device, slot.host, bytes, cudaMemcpyHostToDevice,
                        stream),
        "cudaMemcpyAsync (region table to the device)",
        job_context(regions.size()));
  copy_items_kernel<<<ctas, kKernelThreads, 0, stream>>>(
      static_cast<const KernelItem*>(slot.device), count);
  const cudaError_t launched = cudaGetLastError();
  // Recorded even after a failed launch: the table copy above is in flight.
  check(cudaEventRecord(slot.done, stream), "cudaEventRecord (staging slot)",
        job_context(regions.size()));
  check(launched, "copy kernel launch", job_context(regions.size()));
}

// ---------------------------------------------------------------------------
// DMA
// ---------------------------------------------------------------------------

// Set for good once the runtime or driver reports the batch API unsupported.
std::atomic<bool> g_batch_unsupported{false};
// Set by kv_offload_set_per_copy: one cudaMemcpyAsync per copy, no kernel and
// no batch call (the start-up self-check's next path down).
std::atomic<bool> g_per_copy{false};

#if CUDART_VERSION >= 12080
// One cudaMemcpyBatchAsync for the whole job. Returns the job's workspace, a
// CPU tensor holding every array the call was given (the caller keeps it until
// the copies have completed), or an undefined tensor, having enqueued
// nothing, when the batch API is not supported here.
at::Tensor copy_with_batch_api(const std::vector<CopyRegion>& regions,
                               cudaStream_t stream) {
  const size_t n = regions.size();
  HostArrayLayout layout;
  // Non-const element types convert to both the CUDA 12.8/12.9 signature
  // (void**) and the CUDA 13 one (const void* const*).
  const size_t dsts_at = layout.add<void*>(n);
  const size_t srcs_at = layout.add<void*>(n);
  const size_t sizes_at = layout.add<size_t>(n);
  const size_t attr_at = layout.add<cudaMemcpyAttributes>(1);
  const size_t attr_index_at = layout.add<size_t>(1);
  at::Tensor workspace =
      at::empty({static_cast<int64_t>(layout.bytes())}, at::kByte);
  void* base = workspace.data_ptr();
  void** dsts = place_array<void*>(base, dsts_at, n);
  void** srcs = place_array<void*>(base, srcs_at, n);
  size_t* sizes = place_array<size_t>(base, sizes_at, n);
  for (size_t i = 0; i < n; ++i) {
    dsts[i] = reinterpret_cast<void*>(regions[i].dst);
    srcs[i] = reinterpret_cast<void*>(regions[i].src);
    sizes[i] = regions[i].size;
  }
  auto* attr = place_array<cudaMemcpyAttributes>(base, attr_at, 1);
  attr->srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr->flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t* attr_index = place_array<size_t>(base, attr_index_at, 1);  // 0
#if CUDART_VERSION >= 13000
  size_t fail_index = SIZE_MAX;  // CUDA 13 no longer reports one
  const cudaError_t err =
      cudaMemcpyBatchAsync(dsts, srcs, sizes, n, attr, attr_index, 1, stream);
#else
  size_t fail_index = SIZE_MAX;
  const cudaError_t err = cudaMemcpyBatchAsync(
      dsts, srcs, sizes, n, attr, attr_index, 1, &fail_index, stream);
#endif
  if (err == cudaSuccess) return workspace;
  if (err == cudaErrorNotSupported || err == cudaErrorCallRequiresNewerDriver) {
    (void)cudaGetLastError();
    g_batch_unsupported.store(true);
    TORCH_WARN(kOp, ": cudaMemcpyBatchAsync is not supported here (",
               cudaGetErrorName(err),
               "); using one cudaMemcpyAsync per copy from now on (slower "
               "for many small blocks)");
    return {};
  }
  fail(err, "cudaMemcpyBatchAsync",
       fail_index < n ? fragment_context(regions[fail_index]) : job_context(n));
}
#endif

// Returns the job's workspace (undefined unless the batch API was used).
at::Tensor copy_with_dma(const std::vector<CopyRegion>& regions,
                         cudaStream_t stream, bool pageable) {
#if CUDART_VERSION >= 12080
  // The batch API refuses the legacy default stream; pageable memory takes
  // the long-established per-copy path, which stages it.
  const bool legacy_stream = stream == nullptr || stream == cudaStreamLegacy;
  if (!pageable && !legacy_stream && !g_batch_unsupported.load() &&
      !g_per_copy.load()) {
    at::Tensor workspace = copy_with_batch_api(regions, stream);
    if (workspace.defined()) return workspace;
  }
#else
  (void)pageable;
#endif
  for (const CopyRegion& r : regions) {
    const cudaError_t err = cudaMemcpyAsync(
        reinterpret_cast<void*>(r.dst), reinterpret_cast<const void*>(r.src),
        r.size, cudaMemcpyDefault, stream);
    if (err != cudaSuccess) fail(err, "cudaMemcpyAsync", fragment_context(r));
  }
  return {};  // cudaMemcpyAsync takes no arrays
}

// ---------------------------------------------------------------------------
// Planning
// ---------------------------------------------------------------------------

enum class Method { kAuto, kKernel, kDma };

Method method_from_env() {
  const char* value = std::getenv(kMethodEnv);
  const std::string_view v = value == nullptr ? "" : value;
  if (v.empty() || v == "auto") return Method::kAuto;
  if (v == "kernel") return Method::kKernel;
  if (v == "dma") return Method::kDma;
  TORCH_CHECK(false, kOp, ": ", kMethodEnv, "='", v,
              "' is not one of 'auto', 'kernel', 'dma'; unset it for auto");
}

cudaPointerAttributes attributes(uint64_t addr, const char* side,
                                 const CopyRegion& r) {
  cudaPointerAttributes a{};
  const cudaError_t err =
      cudaPointerGetAttributes(&a, reinterpret_cast<const void*>(addr));
  if (err != cudaSuccess) {
    fail(err, c10::str("cudaPointerGetAttributes (", side, ")").c_str(),
         fragment_context(r));
  }
  return a;
}

// Whether the current device can dereference `addr` as is.
bool device_accessible(const cudaPointerAttributes& a, uint64_t addr,
                       int device) {
  if (a.type == cudaMemoryTypeDevice) return a.device == device;
  return a.type == cudaMemoryTypeHost &&
         reinterpret_cast<uint64_t>(a.devicePointer) == addr;
}

}  // namespace

void set_per_copy_cuda(bool on) { g_per_copy.store(on); }

at::Tensor swap_blocks_cuda(const std::vector<CopyRegion>& regions) {
  if (regions.empty()) return {};
  const Method method = method_from_env();  // a bad value raises first
  const uint64_t total = total_bytes_of_disjoint_copies(regions, kOp);

  TORCH_CHECK(c10::cuda::device_count() > 0, kOp,
              ": no CUDA device is visible to this process (check the "
              "driver, nvidia-smi and CUDA_VISIBLE_DEVICES)");
  // The device side of fragment 0 picks the device (and so the stream).
  const CopyRegion& r0 = regions.front();
  const c10::DeviceIndex current = c10::cuda::current_device();
  cudaPointerAttributes src = attributes(r0.src, "source", r0);
  cudaPointerAttributes dst = attributes(r0.dst, "destination", r0);
  c10::DeviceIndex device = current;
  if (src.type == cudaMemoryTypeDevice) {
    device = static_cast<c10::DeviceIndex>(src.device);
  } else if (dst.type == cudaMemoryTypeDevice) {
    device = static_cast<c10::DeviceIndex>(dst.device);
  }
  const c10::cuda::CUDAGuard guard(device);
  if (device != current) {  // host mappings are per device: ask again
    src = attributes(r0.src, "source", r0);
    dst = attributes(r0.dst, "destination", r0);
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();

  // Enqueued work would be captured with the staging buffers' addresses, and
  // replayed after they have been reused.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  check(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing",
        job_context(regions.size()));
  TORCH_CHECK(capture == cudaStreamCaptureStatusNone, kOp,
              ": the current stream is being captured into a CUDA graph; "
              "issue the copies outside graph capture");

  const bool pageable = src.type == cudaMemoryTypeUnregistered ||
                        dst.type == cudaMemoryTypeUnregistered;
  if (pageable) {
    TORCH_WARN_ONCE(kOp,
                    ": host memory is not page-locked (fragment 0); copying "
                    "with cudaMemcpyAsync, which is slow and synchronous for "
                    "pageable memory. Allocate the host buffer with "
                    "pin_memory=True");
  }
  const bool kernel_ok = device_accessible(src, r0.src, device) &&
                         device_accessible(dst, r0.dst, device);
  // Auto: the 16-CTA kernel is meant for PCIe transfers; device-to-device
  // jobs (far faster than 16 CTAs can copy) take the dma path.
  const bool host_side =
      src.type == cudaMemoryTypeHost || dst.type == cudaMemoryTypeHost;
  const bool small = total / regions.size() < kKernelMaxMeanBytes;
  const bool use_kernel = kernel_ok && !g_per_copy.load() &&
                          (method == Method::kKernel ||
                           (method == Method::kAuto && small && host_side));
  if (use_kernel) {
    // Its region table lives in a staging slot guarded by an event.
    copy_with_kernel(regions, stream, device);
    return {};
  }
  return copy_with_dma(regions, stream, pageable);
}

}  // namespace vllm_ascend::kv_offload
