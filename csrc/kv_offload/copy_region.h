// Torch-free types shared by the dispatcher and the backend cores, so that
// those cores (e.g. csrc/kv_offload/npu/acl_batch_copy.cpp) can be built and
// tested without torch: CopyRegion, one copy of swap_blocks_batch after
// coalescing (see ops.h), and the layout of a workspace.
#pragma once

#include <cstddef>
#include <cstdint>
#include <new>
#include <type_traits>

namespace vllm_ascend::kv_offload {

// Addresses are unsigned so that range arithmetic is well defined.
struct CopyRegion {
  uint64_t src;
  uint64_t dst;
  uint64_t size;
  int64_t first_fragment;  // index of the first merged fragment, for errors
};

// Arrays packed into one block of caller-owned host memory, a "workspace",
// which the caller keeps until the job's copies have completed (why: ops.h,
// Returns). Byte offsets of consecutive arrays in a workspace. The same
// sequence of add() calls gives the same layout, so a backend can size a
// workspace first and fill the one its caller allocated later.
class HostArrayLayout {
 public:
  // What a workspace's address must be a multiple of (operator new and
  // torch's CPU allocator give at least this).
  static constexpr size_t kAlignment = alignof(std::max_align_t);

  // Reserves `n` objects of T after the previous array; returns their offset.
  template <typename T>
  size_t add(size_t n) {
    static_assert(std::is_trivially_copyable_v<T> && alignof(T) <= kAlignment);
    const size_t offset = (bytes_ + alignof(T) - 1) / alignof(T) * alignof(T);
    bytes_ = offset + n * sizeof(T);
    return offset;
  }

  // Bytes of a workspace that holds every array added so far.
  size_t bytes() const { return bytes_; }

 private:
  size_t bytes_ = 0;
};

// The `n` objects of T at byte `offset` of `workspace`, value-initialised
// (zeroed for plain structs).
template <typename T>
T* place_array(void* workspace, size_t offset, size_t n) {
  auto* first =
      reinterpret_cast<T*>(static_cast<unsigned char*>(workspace) + offset);
  for (size_t i = 0; i < n; ++i) ::new (static_cast<void*>(first + i)) T();
  return first;
}

}  // namespace vllm_ascend::kv_offload
