// "cpu" backend of swap_blocks_batch: synchronous memcpy in the calling
// thread, fanned out over std::threads when the volume is large enough for
// memory bandwidth (not thread start-up, ~tens of us) to dominate.
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

#include "ops.h"

namespace vllm_ascend {
namespace {

// Below this many bytes per thread, another thread costs more than it saves.
constexpr uint64_t kMinBytesPerThread = uint64_t{4} << 20;

// Copies bytes [begin, end) of the concatenation of all regions; `offsets[i]`
// is where region i starts in that concatenation. Splitting by bytes rather
// than by region balances the threads even for one huge merged copy.
void copy_byte_range(const std::vector<CopyRegion>& regions,
                     const std::vector<uint64_t>& offsets, uint64_t begin,
                     uint64_t end) {
  size_t i = static_cast<size_t>(
      std::upper_bound(offsets.begin(), offsets.end(), begin) -
      offsets.begin() - 1);
  while (begin < end) {
    const CopyRegion& r = regions[i];
    const uint64_t skip = begin - offsets[i];
    const uint64_t n = std::min(r.size - skip, end - begin);
    std::memcpy(reinterpret_cast<void*>(r.dst + skip),
                reinterpret_cast<const void*>(r.src + skip), n);
    begin += n;
    ++i;
  }
}

}  // namespace

void swap_blocks_cpu(const std::vector<CopyRegion>& regions) {
  // memcpy on overlapping ranges is undefined: reject before copying anything.
  uint64_t total = 0;
  for (const CopyRegion& r : regions) {
    TORCH_CHECK(r.src + r.size <= r.dst || r.dst + r.size <= r.src,
                "swap_blocks_batch(device='cpu'): source and destination of "
                "fragment ",
                r.first_fragment,
                " (after merging adjacent fragments) overlap (src_addrs=",
                r.src, ", dst_addrs=", r.dst, ", bytes=", r.size,
                "); source and destination ranges must be disjoint");
    total += r.size;
  }

  const uint64_t hw = std::max(1u, std::thread::hardware_concurrency());
  const uint64_t threads =
      std::max<uint64_t>(1, std::min(hw, total / kMinBytesPerThread));
  if (threads == 1) {
    for (const CopyRegion& r : regions) {
      std::memcpy(reinterpret_cast<void*>(r.dst),
                  reinterpret_cast<const void*>(r.src), r.size);
    }
    return;
  }

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
    copy_byte_range(regions, offsets, start(k), start(k + 1));
  };

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
}

}  // namespace vllm_ascend
