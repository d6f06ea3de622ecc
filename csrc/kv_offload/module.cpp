// Python module vllm_ascend.kv_offload._C_kv_offload (standalone build only).
// Importing it loads the shared library, whose static TORCH_LIBRARY_FRAGMENT
// initialiser (dispatch.cpp) registers torch.ops._C_ascend.kv_offload_*; the
// module itself has nothing else to offer, so a bare module init serves.
#include <Python.h>

static struct PyModuleDef kv_offload_module = {
    PyModuleDef_HEAD_INIT,
    "_C_kv_offload",
    "vllm-ascend KV offloading native ops; importing registers "
    "torch.ops._C_ascend.kv_offload_swap_blocks and kv_offload_backends",
    -1,
    nullptr,
};

PyMODINIT_FUNC PyInit__C_kv_offload(void) {
  return PyModule_Create(&kv_offload_module);
}
