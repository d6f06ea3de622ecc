// Native ops of vllm-ascend's KV-cache offloading.
//
// kv_offload_swap_blocks
// ======================
//
//   torch.ops._C_ascend.kv_offload_swap_blocks(
//       Tensor src_addrs, Tensor dst_addrs, Tensor sizes, str device,
//       bool per_copy=False) -> (int copies, Tensor workspace)
//   torch.ops._C_ascend.kv_offload_backends() -> str[]
//
// Namespace _C_ascend is shared with upstream vllm-ascend's library, which
// owns it (TORCH_LIBRARY) and has an unrelated swap_blocks_batch; ours are
// added as a fragment under names of their own (dispatch.cpp). Python calls
// the .default overloads. In C++ the function is still swap_blocks_batch.
//
// Copies a batch of raw memory fragments: fragment i copies sizes[i] bytes
// from address src_addrs[i] to address dst_addrs[i].
//
// Arguments
//   src_addrs, dst_addrs, sizes
//       1-D, contiguous, CPU, int64 tensors of equal length N. They are
//       descriptors only: the memory they point at may live on any device.
//   device
//       Backend that performs the copy: "cpu" or "npu". A backend whose
//       source was not compiled into the extension raises "backend
//       '<device>' was not compiled into this build"; any other string
//       raises "unknown device". (CUDA copies are vLLM's own
//       swap_blocks_batch: vllm_ascend/kv_offload/copy_paths.py.)
//   per_copy
//       True: one async memcpy per (merged) copy instead of the batch API
//       ("npu": aclrtMemcpyAsync, no aclrtMemcpyBatchAsync), for a runtime
//       whose batch call misbehaves: the start-up self-check's next path
//       down (vllm_ascend/kv_offload/self_check.py). Per call, no state;
//       "cpu" ignores it (one code path).
//
// Returns (copies, workspace)
//   copies: the number of copies actually submitted after coalescing (0 when
//       N == 0).
//   workspace: a 1-D uint8 CPU tensor holding the host memory that the
//       backend's asynchronous copies may still read after the op has
//       returned: the descriptor arrays handed to aclrtMemcpyBatchAsync,
//       whose documentation does not say that the
//       runtime has read them when the call returns. The caller keeps a
//       reference to it until the copies have COMPLETED (e.g. until an event
//       recorded on that stream after the op has completed), not merely until
//       the op returns; vllm_ascend's StreamTransferQueue keeps it with the
//       job until the job's end event. Empty (numel 0) when nothing outlives
//       the call: "cpu" (synchronous), N == 0, and the paths that pass no
//       host arrays ("npu" per copy). Its contents are the backend's own
//       business.
//
// Coalescing
//   Consecutive fragments i, i + 1 with src[i] + size[i] == src[i + 1] AND
//   dst[i] + size[i] == dst[i + 1] are merged into one copy (repeatedly, so a
//   run of k adjacent fragments becomes one copy). This is what makes copying
//   a run of physically adjacent KV blocks cost one memcpy / DMA instead of k.
//
// Validation (c10::Error, i.e. RuntimeError in Python, before any byte moves)
//   - wrong dtype / device / dim / contiguity of a descriptor tensor,
//   - descriptor tensors of unequal length,
//   - a size <= 0, a null source or destination address, a range that wraps
//     around the end of the address space, sizes that add up to more than
//     2^64 - 1 bytes,
//   - "cpu" only: a (merged) copy whose source and destination ranges
//     overlap. Overlap *between* different fragments is not checked; the
//     copies may run concurrently and in any order, so the result is then
//     undefined. Callers must not alias destinations with other sources.
//   An empty batch (N == 0) is valid and returns 0.
//
// Backend semantics
//   "cpu": synchronous; the copy is finished when the op returns. Runs in the
//       calling thread, plus extra std::threads for large volumes:
//       threads = max(1, min(CPUs in the calling thread's affinity mask,
//       total_bytes / 4 MiB)); the merged copies are split among them by byte
//       range, so even a single huge copy is parallelised. Jobs of >= 8 MiB
//       are copied with AVX2 non-temporal stores where the CPU has AVX2
//       (x86-64; checked at run time), memcpy otherwise and for smaller jobs;
//       VLLM_ASCEND_CPU_COPY_METHOD=auto|memcpy|stream overrides ("stream"
//       without AVX2 uses memcpy; any other value raises). The GIL is not
//       held while copying (calls through torch.ops release it before
//       entering the kernel).
//   "npu": asynchronous. Enqueued on torch_npu's current stream of the current
//       device, c10_npu::getCurrentNPUStream().stream(), which first flushes
//       torch_npu's task queue, so the copies are ordered after torch ops
//       already issued on that stream. The op returns once the copies are
//       enqueued: synchronize the stream (or record an event) before reading
//       the destination or reusing the source.
//       Direction: host <-> device only. The dispatcher knows addresses only,
//       so the backend determines the direction ONCE per call, from fragment
//       0, with aclrtPointerGetAttributes. The host side must be page-locked
//       memory known to ACL (torch pin_memory=True, i.e. aclrtMallocHost);
//       pageable host memory, device-to-device and host-to-host at fragment
//       0 raise before anything is enqueued. Every later fragment must match
//       fragment 0 (direction and kind of memory); one that does not is left
//       to the runtime's own check, whose failure names that fragment.
//       Copies: aclrtMemcpyBatchAsync with one attribute set per call (the
//       locations aclrtPointerGetAttributes reported), at most 4096 entries a
//       call. Its host arrays (srcs, dsts, sizes for every entry of every
//       call, the attribute set and its index) are built in the returned
//       workspace, never in memory freed when the op returns. When the batch
//       API answers "not supported"
//       (ACL_ERROR_RT_FEATURE_NOT_SUPPORT, ACL_ERROR_FEATURE_UNSUPPORTED or
//       ACL_ERROR_API_NOT_SUPPORT) or the runtime lacks the symbol (CANN <
//       8.3), the process switches for good to one aclrtMemcpyAsync per copy
//       and warns once. Any other ACL error raises, naming the ACL call, the
//       error code and the caller's fragment index (translated from
//       failIndex); copies enqueued by earlier calls of the same op are not
//       undone, so the destination is then undefined, but the op waits for
//       them (aclrtSynchronizeStream) before raising, as their arrays are
//       in the workspace it frees. Copies within one call run in no
//       particular order. What ran where: docs/npu_backend.md.
//
// kv_offload_host_register
// ========================
//
//   torch.ops._C_ascend.kv_offload_host_register(int addr, int size, str
//   device, int flags=0x10000002)
//   torch.ops._C_ascend.kv_offload_host_unregister(int addr, str device)
//
// Makes the existing host range [addr, addr + size) page-locked memory that
// the `device` backend of kv_offload_swap_blocks accepts, and undoes it.
// For host memory that is not allocated pinned: vLLM's shared /dev/shm
// offload region (NPUTieringOffloadingSpec), which every worker maps.
//   "npu": aclrtHostRegisterV2(addr, size, flags) ("register pageable host
//       memory as page-locked memory", CANN docs); flags is
//       ACL_HOST_REG_MAPPED (0x2), optionally | ACL_HOST_REG_PINNED
//       (0x10000000; the default is both, A5 rejects PINNED), then
//       aclrtPointerGetAttributes on its first and last byte must report
//       page-locked host memory (else it is unregistered again and the call
//       raises). addr must be 4 KiB-aligned and non-zero, size > 0 (checked
//       before any ACL call). Unregister with the same addr, after every copy
//       from or to the range has completed and before it is unmapped:
//       aclrtHostUnregister(addr). Errors (c10::Error) name the range, the
//       ACL call, its error code and the runtime's message. What ran where:
//       docs/npu_backend.md.
//   "cuda" and "cpu" raise: cuda registers through vLLM's host_register
//       (cudaHostRegister) and copies with vLLM's op; the cpu backend copies
//       pageable memory.
//   A backend not compiled in raises "backend '<device>' was not compiled
//   into this build".
//
// kv_offload_host_alloc
// =====================
//
//   torch.ops._C_ascend.kv_offload_host_alloc(int size, str device) -> int
//   torch.ops._C_ascend.kv_offload_host_free(int addr, str device) -> ()
//
// Exact-size page-locked host memory for the CPU block pool
// (vllm_ascend/kv_offload/host_memory.py), not through torch's caching host
// allocator, which rounds an allocation up to a power of two.
//   "npu": aclrtMallocHost(size), then aclrtPointerGetAttributes on its first
//       and last byte must report page-locked host memory (else it is freed
//       again and the call raises); free with aclrtFreeHost(addr) after every
//       copy from or to it has completed. Errors name the size or address,
//       the ACL call and its code. Status: SIMULATED ACL only.
//   "cuda" and "cpu" raise (cuda: mmap + vLLM's host_register).
//
// Adding a backend
//   1. Declare `at::Tensor swap_blocks_<name>(const std::vector<CopyRegion>&,
//      bool per_copy)`
//      below, guarded by VLLM_ASCEND_WITH_<NAME>; it returns the workspace
//      (see Returns; an undefined tensor when it needs none).
//   2. Implement it in csrc/kv_offload/<name>/ (one translation unit per
//   backend).
//   3. Add it to kBackends in csrc/kv_offload/dispatch.cpp and a CMake option
//      VLLM_ASCEND_WITH_<NAME> that compiles the file and defines the macro.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "copy_region.h"  // CopyRegion: one copy after coalescing

namespace vllm_ascend::kv_offload {

// A backend copies every region. Regions arrive validated (non-null, size >
// 0, no wrap-around, total bytes < 2^64) and coalesced; backend-specific
// checks (e.g. overlap on cpu) are the backend's job and must happen before
// the first byte moves. It returns the job's workspace: a CPU tensor holding
// every host array its enqueued copies may still read (see Returns), or an
// undefined tensor when there is none (the dispatcher returns an empty one).
// per_copy: the caller's choice of one async memcpy per copy (see per_copy).
using SwapBlocksBackend = at::Tensor (*)(const std::vector<CopyRegion>& regions,
                                         bool per_copy);

at::Tensor swap_blocks_cpu(const std::vector<CopyRegion>& regions,
                           bool per_copy);
#ifdef VLLM_ASCEND_WITH_NPU
// The "npu" backend and host-memory ops (npu/ops_npu.cpp).
at::Tensor swap_blocks_npu(const std::vector<CopyRegion>& regions,
                           bool per_copy);
void host_register_npu(uint64_t addr, uint64_t size, uint32_t flags);
void host_unregister_npu(uint64_t addr);
uint64_t host_alloc_npu(uint64_t size);
void host_free_npu(uint64_t addr);
#endif

// For backends whose copies must not overlap (memcpy-like): raises, naming
// `op` and the fragment, if any copy's source and destination ranges overlap;
// else returns the total bytes. Call before the first byte moves.
uint64_t total_bytes_of_disjoint_copies(const std::vector<CopyRegion>& regions,
                                        std::string_view op);

// The op registered as torch.ops._C_ascend.kv_offload_swap_blocks:
// (copies, workspace), see Returns.
std::tuple<int64_t, at::Tensor> swap_blocks_batch(const at::Tensor& src_addrs,
                                                  const at::Tensor& dst_addrs,
                                                  const at::Tensor& sizes,
                                                  std::string_view device,
                                                  bool per_copy);

// The ops registered as torch.ops._C_ascend.kv_offload_host_register /
// kv_offload_host_unregister (see "kv_offload_host_register" above).
void host_register(int64_t addr, int64_t size, std::string_view device,
                   int64_t flags);
void host_unregister(int64_t addr, std::string_view device);
int64_t host_alloc(int64_t size, std::string_view device);
void host_free(int64_t addr, std::string_view device);

// Names of the backends compiled into this build, e.g. {"cpu"}
// (torch.ops._C_ascend.kv_offload_backends).
std::vector<std::string> compiled_backends();

// Defines and implements both ops in `m`, a library block of namespace
// _C_ascend: our own fragment (standalone build) or upstream's block (graft).
void register_kv_offload_ops(torch::Library& m);

}  // namespace vllm_ascend::kv_offload
