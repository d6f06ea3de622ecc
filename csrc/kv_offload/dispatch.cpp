// Backend-agnostic part of swap_blocks_batch: descriptor validation,
// coalescing, backend selection and the torch op registration. See ops.h for
// the contract.
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cctype>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

#include "ops.h"

namespace vllm_ascend::kv_offload {
namespace {

struct BackendEntry {
  std::string_view name;
  SwapBlocksBackend fn;
};

// Backends compiled into this build. Adding one = one line here (see ops.h).
constexpr BackendEntry kBackends[] = {
    {"cpu", &swap_blocks_cpu},
#ifdef VLLM_ASCEND_WITH_NPU
    {"npu", &swap_blocks_npu},
#endif
};

// Every device string the op understands, compiled in or not, so that a
// build without a backend can tell "not compiled" apart from a typo.
constexpr std::string_view kKnownDevices[] = {"cpu", "npu"};

std::string compiled_list() {
  std::string out;
  for (const BackendEntry& b : kBackends) {
    out += (out.empty() ? "" : ", ") + std::string(b.name);
  }
  return out;
}

// Raises: `op` needs backend `device`, which this build lacks.
[[noreturn]] void not_compiled(std::string_view op, std::string_view device) {
  std::string upper(device);
  for (char& c : upper) c = static_cast<char>(std::toupper(c));
  TORCH_CHECK(false, op, ": backend '", device,
              "' was not compiled into this build (compiled backends: ",
              compiled_list(), "); rebuild vllm-ascend on a machine with ",
              "that backend's toolchain (CMake option VLLM_ASCEND_WITH_", upper,
              "=ON, see setup.py)");
}

SwapBlocksBackend resolve_backend(std::string_view device) {
  for (const BackendEntry& b : kBackends) {
    if (b.name == device) return b.fn;
  }
  for (std::string_view known : kKnownDevices) {
    if (known == device) not_compiled("swap_blocks_batch", device);
  }
  TORCH_CHECK(false, "swap_blocks_batch: unknown device '", device,
              "'; expected one of 'cpu', 'npu' (cuda copies with vLLM's ",
              "own swap_blocks_batch)");
}

void check_descriptor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "swap_blocks_batch: ", name,
              " must be a CPU tensor (got ", t.device(),
              "); descriptors always live on the host, build them with "
              "device='cpu'");
  TORCH_CHECK(t.scalar_type() == at::kLong, "swap_blocks_batch: ", name,
              " must be an int64 tensor (got ", t.scalar_type(),
              "); build it with dtype=torch.int64");
  TORCH_CHECK(t.dim() == 1, "swap_blocks_batch: ", name, " must be 1-D (got ",
              t.dim(), "-D); flatten it with .view(-1)");
  TORCH_CHECK(t.is_contiguous(), "swap_blocks_batch: ", name,
              " must be contiguous; call .contiguous() on it first");
}

// Validates every fragment and merges runs of adjacent ones (see ops.h).
std::vector<CopyRegion> coalesce(const int64_t* src, const int64_t* dst,
                                 const int64_t* sizes, int64_t n) {
  constexpr uint64_t kMax = std::numeric_limits<uint64_t>::max();
  std::vector<CopyRegion> regions;
  regions.reserve(static_cast<size_t>(n));
  uint64_t total = 0;  // backends count bytes in uint64_t: it must not wrap
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(sizes[i] > 0, "swap_blocks_batch: sizes[", i, "] = ", sizes[i],
                " but every size must be > 0; drop empty fragments first");
    // Addresses are unsigned: int64 is only the transport type.
    const auto s = static_cast<uint64_t>(src[i]);
    const auto d = static_cast<uint64_t>(dst[i]);
    const auto size = static_cast<uint64_t>(sizes[i]);
    TORCH_CHECK(s != 0, "swap_blocks_batch: src_addrs[", i,
                "] is a null address; pass the data_ptr() of an allocated "
                "buffer");
    TORCH_CHECK(d != 0, "swap_blocks_batch: dst_addrs[", i,
                "] is a null address; pass the data_ptr() of an allocated "
                "buffer");
    TORCH_CHECK(
        s <= kMax - size && d <= kMax - size, "swap_blocks_batch: fragment ", i,
        " wraps around the end of the address space (src_addrs=", s,
        ", dst_addrs=", d, ", sizes=", size, "); check the address arithmetic");
    TORCH_CHECK(total <= kMax - size,
                "swap_blocks_batch: the sizes add up to more than 2^64 - 1 "
                "bytes at fragment ",
                i, " (sizes[", i, "]=", size,
                "); no batch can copy more than the address space holds, "
                "check the sizes");
    total += size;
    if (!regions.empty()) {
      CopyRegion& last = regions.back();
      if (last.src + last.size == s && last.dst + last.size == d) {
        last.size += size;
        continue;
      }
    }
    regions.push_back({s, d, size, i});
  }
  return regions;
}

// The workspace of a job that has none (see ops.h, Returns).
at::Tensor no_workspace() { return at::empty({0}, at::kByte); }

}  // namespace

std::tuple<int64_t, at::Tensor> swap_blocks_batch(const at::Tensor& src_addrs,
                                                  const at::Tensor& dst_addrs,
                                                  const at::Tensor& sizes,
                                                  std::string_view device,
                                                  bool per_copy) {
  // Resolve first: a misconfigured device is an error even for empty batches.
  const SwapBlocksBackend backend = resolve_backend(device);
  check_descriptor(src_addrs, "src_addrs");
  check_descriptor(dst_addrs, "dst_addrs");
  check_descriptor(sizes, "sizes");
  const int64_t n = sizes.numel();
  TORCH_CHECK(src_addrs.numel() == n && dst_addrs.numel() == n,
              "swap_blocks_batch: src_addrs, dst_addrs and sizes must have "
              "the same length (got ",
              src_addrs.numel(), ", ", dst_addrs.numel(), ", ", n,
              "); pass exactly one entry per fragment in each");
  if (n == 0) return {0, no_workspace()};
  const std::vector<CopyRegion> regions =
      coalesce(src_addrs.data_ptr<int64_t>(), dst_addrs.data_ptr<int64_t>(),
               sizes.data_ptr<int64_t>(), n);
  at::Tensor workspace = backend(regions, per_copy);
  if (!workspace.defined()) workspace = no_workspace();
  return {static_cast<int64_t>(regions.size()), std::move(workspace)};
}

uint64_t total_bytes_of_disjoint_copies(const std::vector<CopyRegion>& regions,
                                        std::string_view op) {
  uint64_t total = 0;
  for (const CopyRegion& r : regions) {
    TORCH_CHECK(r.src + r.size <= r.dst || r.dst + r.size <= r.src, op,
                ": source and destination of fragment ", r.first_fragment,
                " (after merging adjacent fragments) overlap (src_addrs=",
                r.src, ", dst_addrs=", r.dst, ", bytes=", r.size,
                "); source and destination ranges must be disjoint");
    total += r.size;
  }
  return total;
}

// The host-memory ops serve "npu" only; "cuda" and "cpu" need none of them.
// One message for all four ops.
namespace {
void check_host_device(std::string_view op, std::string_view device) {
  TORCH_CHECK(device == "npu" || device == "cuda" || device == "cpu", op,
              ": unknown device '", device, "'; expected 'npu'");
  TORCH_CHECK(device == "npu", op, ": device '", device,
              "' is not supported; only 'npu' is implemented (cuda and cpu "
              "need no host-memory op: cuda pins with vLLM's host_register, "
              "i.e. cudaHostRegister, on an mmap; cpu copies pageable mmap "
              "memory as is)");
}
}  // namespace

void host_register([[maybe_unused]] int64_t addr, [[maybe_unused]] int64_t size,
                   std::string_view device, [[maybe_unused]] int64_t flags) {
  check_host_device("kv_offload_host_register", device);
#ifdef VLLM_ASCEND_WITH_NPU
  TORCH_CHECK(addr >= 0 && size > 0, "kv_offload_host_register: addr=", addr,
              ", size=", size, " is not a host range");
  TORCH_CHECK(flags > 0 && flags <= UINT32_MAX,
              "kv_offload_host_register: flags=", flags,
              " is not a 32-bit ACL_HOST_REG_* mask");
  host_register_npu(static_cast<uint64_t>(addr), static_cast<uint64_t>(size),
                    static_cast<uint32_t>(flags));
#else
  not_compiled("kv_offload_host_register", device);
#endif
}

void host_unregister([[maybe_unused]] int64_t addr, std::string_view device) {
  check_host_device("kv_offload_host_unregister", device);
#ifdef VLLM_ASCEND_WITH_NPU
  host_unregister_npu(static_cast<uint64_t>(addr));
#else
  not_compiled("kv_offload_host_unregister", device);
#endif
}

int64_t host_alloc(int64_t size, std::string_view device) {
  check_host_device("kv_offload_host_alloc", device);
  TORCH_CHECK(size > 0, "kv_offload_host_alloc: size=", size, " must be > 0");
#ifdef VLLM_ASCEND_WITH_NPU
  return static_cast<int64_t>(host_alloc_npu(static_cast<uint64_t>(size)));
#else
  not_compiled("kv_offload_host_alloc", device);
#endif
}

void host_free([[maybe_unused]] int64_t addr, std::string_view device) {
  check_host_device("kv_offload_host_free", device);
#ifdef VLLM_ASCEND_WITH_NPU
  host_free_npu(static_cast<uint64_t>(addr));
#else
  not_compiled("kv_offload_host_free", device);
#endif
}

std::vector<std::string> compiled_backends() {
  std::vector<std::string> names;
  for (const BackendEntry& b : kBackends) names.emplace_back(b.name);
  return names;
}

void register_kv_offload_ops(torch::Library& m) {
  // Descriptor tensors are always CPU and the `device` string picks the
  // backend, so one CompositeExplicitAutograd kernel serves every dispatch
  // key. The names carry a kv_offload_ prefix: the namespace is shared with
  // upstream vllm-ascend's library (which has its own swap_blocks_batch).
  auto def = [&m](const char* schema, auto fn) {
    m.def(schema, torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd,
                                  std::move(fn)));
  };
  def("kv_offload_swap_blocks(Tensor src_addrs, Tensor dst_addrs, "
      "Tensor sizes, str device, bool per_copy=False) -> "
      "(int copies, Tensor workspace)",
      TORCH_FN(swap_blocks_batch));
  def("kv_offload_host_register(int addr, int size, str device, "
      "int flags=268435458) -> ()",
      TORCH_FN(host_register));
  def("kv_offload_host_unregister(int addr, str device) -> ()",
      TORCH_FN(host_unregister));
  def("kv_offload_host_alloc(int size, str device) -> int",
      TORCH_FN(host_alloc));
  def("kv_offload_host_free(int addr, str device) -> ()", TORCH_FN(host_free));
  def("kv_offload_backends() -> str[]", TORCH_FN(compiled_backends));
}

}  // namespace vllm_ascend::kv_offload

// Standalone build: a FRAGMENT, never TORCH_LIBRARY, so that upstream
// vllm-ascend's TORCH_LIBRARY(_C_ascend) loads in the same process in either
// order. Grafted into upstream, its own block calls register_kv_offload_ops
// instead (docs/upstream_graft.md).
#ifndef VLLM_ASCEND_KV_OFFLOAD_GRAFTED
TORCH_LIBRARY_FRAGMENT(_C_ascend, m) {
  vllm_ascend::kv_offload::register_kv_offload_ops(m);
}
#endif
