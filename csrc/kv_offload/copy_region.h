// CopyRegion: one copy of swap_blocks_batch after coalescing (see ops.h).
// Kept free of torch headers so that torch-independent backend cores (e.g.
// csrc/kv_offload/npu/acl_batch_copy.cpp) can be built and tested without
// torch.
#pragma once

#include <cstdint>

namespace vllm_ascend::kv_offload {

// Addresses are unsigned so that range arithmetic is well defined.
struct CopyRegion {
  uint64_t src;
  uint64_t dst;
  uint64_t size;
  int64_t first_fragment;  // index of the first merged fragment, for errors
};

}  // namespace vllm_ascend::kv_offload
