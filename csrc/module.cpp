// Python module vllm_ascend._C_ascend. Importing it loads the shared library,
// whose static TORCH_LIBRARY initialiser (dispatch.cpp) registers
// torch.ops._C_ascend.*; the module itself only exposes build introspection.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "ops.h"

PYBIND11_MODULE(_C_ascend, m) {
  m.doc() =
      "vllm-ascend native ops; importing registers "
      "torch.ops._C_ascend.swap_blocks_batch";
  m.def("backends", &vllm_ascend::compiled_backends,
        "Names of the swap_blocks_batch backends compiled into this build.");
}
