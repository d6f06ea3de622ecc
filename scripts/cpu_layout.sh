# shellcheck shell=bash
# Sourced by the scripts that start vLLM engines on its CPU backend.
#
# On a machine with 2 cores, leave the last one to the engine core process
# and the offload copy thread. vLLM's CPU backend reserves one core for the
# engine core and one more whenever a kv_transfer_config is set; with 2 cores
# that is all of them, so it warns ("Selected CPU core number (2) should be
# greater than reserved CPU core number (2)") and runs its compute threads on
# both cores, which halved decoding speed here (docs/e2e_benchmark.md,
# finding 4). Binding compute to the first core is the layout it uses
# without a connector. VLLM_CPU_NUM_OF_RESERVED_CPU=1 gives that layout too,
# but makes vLLM warn that 1 is below its minimum (2), so the binding is set
# instead. Either variable set by the caller wins.
if [[ -z ${VLLM_CPU_OMP_THREADS_BIND:-} && -z ${VLLM_CPU_NUM_OF_RESERVED_CPU:-} ]] &&
  [[ $(nproc) -eq 2 ]]; then
  VLLM_CPU_OMP_THREADS_BIND=$(python3 -c 'import os; print(min(os.sched_getaffinity(0)))')
  export VLLM_CPU_OMP_THREADS_BIND
fi
