// gradcomp/cuda/kernels/select_kernels.cuh: the kernels of the device selectors. Tile kernels
// (one tile of threads * items consecutive elements per block) read g once each; list selects
// (many blocks, the last one deciding) order the sample and the candidates; single-block
// kernels work on short lists (per-tile counts, histograms) and make the decisions the host
// selectors make between passes, so no pass waits for the host.
// Every kernel after the first reads the pipeline's select_state in device memory; a kernel
// whose gate bits are not set in state->mode returns at once (the paths not taken cost a
// launch each, not a read of g).
//
// One topic a header: select_state.cuh (the state, the values a pass reads, setup kernels),
// list_select_kernels.cuh, topk_kernels.cuh, radix_kernels.cuh (radix select and the ordered
// take), gaussiank_kernels.cuh and feedback_kernels.cuh (the residual feedback's, which are
// not a selector's).
#pragma once

#include <gradcomp/cuda/kernels/feedback_kernels.cuh>
#include <gradcomp/cuda/kernels/gaussiank_kernels.cuh>
#include <gradcomp/cuda/kernels/radix_kernels.cuh>
#include <gradcomp/cuda/kernels/select_state.cuh>
#include <gradcomp/cuda/kernels/topk_kernels.cuh>
