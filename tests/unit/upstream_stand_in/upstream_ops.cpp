// Stand-in for upstream vllm-ascend's native library, reduced to what can
// collide with ours: it owns namespace _C_ascend with TORCH_LIBRARY (only one
// such block may exist per namespace and process) and defines its own
// swap_blocks_batch with upstream 0.30's schema. Its kernel marks that it ran
// by filling `z` with 7 + direction, so a test can tell whose kernel a call
// reached.
#include <ATen/ATen.h>
#include <torch/library.h>

namespace {

void stand_in_swap_blocks_batch(const at::Tensor& x, const at::Tensor& y,
                                const at::Tensor& z, int64_t direction) {
  (void)x;
  (void)y;
  at::Tensor out = z;
  out.fill_(7 + direction);
}

}  // namespace

TORCH_LIBRARY(_C_ascend, ops) {
  ops.def(
      "swap_blocks_batch(Tensor x, Tensor y, Tensor z, int direction) -> ()");
  ops.impl("swap_blocks_batch", c10::DispatchKey::CPU,
           TORCH_FN(stand_in_swap_blocks_batch));
}
