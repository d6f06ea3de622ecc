// Python module vllm_ascend.kv_offload._C_kv_offload (standalone build only).
// Importing it loads the shared library, whose static TORCH_LIBRARY_FRAGMENT
// initialiser (dispatch.cpp) registers torch.ops._C_ascend.kv_offload_*; the
// module itself has nothing else to offer.
#include <pybind11/pybind11.h>

PYBIND11_MODULE(_C_kv_offload, m) {
  m.doc() =
      "vllm-ascend KV offloading native ops; importing registers "
      "torch.ops._C_ascend.kv_offload_swap_blocks and kv_offload_backends";
}
