// "cpu" backend of swap_blocks_batch: synchronous copies in the calling
// thread, fanned out over std::threads when the volume is large enough for
// memory bandwidth (not thread start-up, ~tens of us) to dominate.
//
// Large jobs are copied with non-temporal (streaming) stores where the CPU
// has AVX2: a KV job of many MiB does not fit in cache, and writing around
// it saves the read-for-ownership of every destination line, which is what
// bounds a plain memcpy of scattered fragments (docs/benchmarks.md). Small
// jobs keep memcpy so that their destination stays in cache.
// VLLM_ASCEND_CPU_COPY_METHOD=auto|memcpy|stream overrides the choice.
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <system_error>
#include <thread>
#include <vector>

#if defined(__linux__)
#include <sched.h>
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define VLLM_ASCEND_CPU_STREAM_COPY 1
#endif

#include "ops.h"

namespace vllm_ascend::kv_offload {
namespace {

constexpr const char* kOp = "swap_blocks_batch(device='cpu')";
constexpr const char* kMethodEnv = "VLLM_ASCEND_CPU_COPY_METHOD";

// Below this many bytes per thread, another thread costs more than it saves.
constexpr uint64_t kMinBytesPerThread = uint64_t{4} << 20;
// "auto" streams jobs of at least this many bytes: beyond a core's L2 and a
// good part of a typical L3, so the destination would be evicted before
// anyone reads it anyway.
constexpr uint64_t kMinStreamJobBytes = uint64_t{8} << 20;
// Pieces shorter than this are memcpy'd even in a streaming job: aligning
// the destination and fencing would cost more than the stores save.
constexpr uint64_t kMinStreamPieceBytes = 1024;

enum class Method { kAuto, kMemcpy, kStream };

Method method_from_env() {
  const char* value = std::getenv(kMethodEnv);
  const std::string_view v = value == nullptr ? "" : value;
  if (v.empty() || v == "auto") return Method::kAuto;
  if (v == "memcpy") return Method::kMemcpy;
  if (v == "stream") return Method::kStream;
  TORCH_CHECK(false, kOp, ": ", kMethodEnv, "='", v,
              "' is not one of 'auto', 'memcpy', 'stream'; unset it for auto");
}

#ifdef VLLM_ASCEND_CPU_STREAM_COPY
bool stream_copy_supported() {
  static const bool avx2 = __builtin_cpu_supports("avx2");
  return avx2;
}

// memcpy with 32-byte non-temporal stores. Compiled for AVX2 only here, so
// the rest of the extension runs on any x86-64; callers check
// stream_copy_supported() first. Stores are weakly ordered: the thread must
// _mm_sfence() before its copies may be observed (copy_share does).
__attribute__((target("avx2"))) void stream_copy(uint8_t* dst,
                                                 const uint8_t* src,
                                                 uint64_t n) {
  const uint64_t head = std::min<uint64_t>(
      n, (32 - (reinterpret_cast<uintptr_t>(dst) & 31)) & 31);
  std::memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  // Four loads in flight, then four stores: one 128-byte step per iteration.
  for (; n >= 128; n -= 128, src += 128, dst += 128) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src));
    const __m256i b =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32));
    const __m256i c =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 64));
    const __m256i d =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(dst + 96), d);
  }
  for (; n >= 32; n -= 32, src += 32, dst += 32) {
    _mm256_stream_si256(
        reinterpret_cast<__m256i*>(dst),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
  }
  std::memcpy(dst, src, n);
}

void store_fence() { _mm_sfence(); }
#else
// No streaming copy on this architecture (e.g. aarch64): memcpy throughout.
bool stream_copy_supported() { return false; }
void stream_copy(uint8_t* dst, const uint8_t* src, uint64_t n) {
  std::memcpy(dst, src, n);
}
void store_fence() {}
#endif

bool use_stream_copy(Method method, uint64_t total) {
  switch (method) {
    case Method::kMemcpy:
      return false;
    case Method::kStream:
      // Forced, but still only where the instructions exist.
      return stream_copy_supported();
    case Method::kAuto:
      break;
  }
  return total >= kMinStreamJobBytes && stream_copy_supported();
}

void copy_piece(uint64_t dst, uint64_t src, uint64_t n, bool stream) {
  if (stream && n >= kMinStreamPieceBytes) {
    stream_copy(reinterpret_cast<uint8_t*>(dst),
                reinterpret_cast<const uint8_t*>(src), n);
  } else {
    std::memcpy(reinterpret_cast<void*>(dst),
                reinterpret_cast<const void*>(src), n);
  }
}

// CPUs the calling thread may run on. vLLM's CPU worker binds its threads to
// a few cores; more copy threads than that only take turns on them.
uint64_t usable_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return static_cast<uint64_t>(n);
  }
#endif
  return std::max(1u, std::thread::hardware_concurrency());
}

// Copies bytes [begin, end) of the concatenation of all regions; `offsets[i]`
// is where region i starts in that concatenation. Splitting by bytes rather
// than by region balances the threads even for one huge merged copy.
void copy_byte_range(const std::vector<CopyRegion>& regions,
                     const std::vector<uint64_t>& offsets, uint64_t begin,
                     uint64_t end, bool stream) {
  size_t i = static_cast<size_t>(
      std::upper_bound(offsets.begin(), offsets.end(), begin) -
      offsets.begin() - 1);
  while (begin < end) {
    const CopyRegion& r = regions[i];
    const uint64_t skip = begin - offsets[i];
    const uint64_t n = std::min(r.size - skip, end - begin);
    copy_piece(r.dst + skip, r.src + skip, n, stream);
    begin += n;
    ++i;
  }
  // Streaming stores must be globally visible before this share counts as
  // done; join() (or the op's return) then publishes them.
  if (stream) store_fence();
}

}  // namespace

// Synchronous: nothing outlives the call, so there is no workspace.
at::Tensor swap_blocks_cpu(const std::vector<CopyRegion>& regions,
                           bool /*per_copy: one code path*/) {
  const Method method = method_from_env();  // a bad value raises first
  // memcpy on overlapping ranges is undefined: reject before copying anything.
  const uint64_t total = total_bytes_of_disjoint_copies(regions, kOp);
  if (regions.empty()) return {};

  const bool stream = use_stream_copy(method, total);
  const uint64_t threads = std::max<uint64_t>(
      1, std::min(usable_cpus(), total / kMinBytesPerThread));
  std::vector<uint64_t> offsets(regions.size());
  uint64_t offset = 0;
  for (size_t i = 0; i < regions.size(); ++i) {
    offsets[i] = offset;
    offset += regions[i].size;
  }
  // Share k gets bytes [start(k), start(k + 1)); the first `rem` get one more.
  const uint64_t base = total / threads;
  const uint64_t rem = total % threads;
  auto start = [&](uint64_t k) { return k * base + std::min(k, rem); };
  auto copy_share = [&](uint64_t k) {
    copy_byte_range(regions, offsets, start(k), start(k + 1), stream);
  };
  if (threads == 1) {
    copy_share(0);
    return {};
  }

  std::vector<std::thread> workers;
  workers.reserve(threads - 1);
  uint64_t k = 1;
  try {
    for (; k < threads; ++k) workers.emplace_back(copy_share, k);
  } catch (const std::system_error&) {
    // Out of threads: do the remaining shares here rather than fail.
  }
  for (; k < threads; ++k) copy_share(k);
  copy_share(0);
  for (std::thread& w : workers) w.join();
  return {};
}

}  // namespace vllm_ascend::kv_offload
