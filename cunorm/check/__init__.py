"""The correctness checker behind `cunorm check` and the GPU test tier.

Each case draws fresh random inputs (never zeros; rows offset from zero so a
one-pass variance would show), poisons every allocation the op makes with NaN
bytes (so an unwritten element cannot pass), runs the op on the GPU and
compares each output with the float64 reference by relative L2 error.

Rooms: `calls` (what a case runs, derived without a GPU: its dispatch call,
its kernels, compiling them), `inputs` (what a case draws, poisoned
allocations), `runs` (running a case, or a tuner's forced knobs, against the reference), `compare`
(tolerances, errors, the Result of an output). The cases and their sweeps live
in `cunorm.sweeps`. Everything is re-exported here, where the tools find it.
"""
from __future__ import annotations

# The cases and their sweeps live in cunorm.sweeps; re-exported here, where the tools have always found them.
from ..sweeps import (DEFAULT_ROWS, DELTA_HEAD_DIMS, FLAG_SIZES, GENERAL_SIZES, HEURISTIC_SAMPLE,  # noqa: F401
                      LAYOUTS, NORM_OPS, OPS, OUT_LAYOUTS, PAIRWISE_LAYOUTS, PAIRWISE_SIZES, QKV_HEAD_DIMS,
                      QKV_LAYOUT, SHORT_NAMES, SWEEPS, WEIGHT_LAYOUTS, Case, default_cases, flag_cases, fp8_cases,
                      from_output_cases, general_cases, pairwise_cases, pairwise_factors, qkv_cases)
from .calls import case_call, case_kernels, precompile, source_ops  # noqa: F401
from .compare import (DELTA_TOLERANCE, DELTA_TOLERANCE_FP32, FP8_BITWISE_SHARE, FP8_FLOOR,  # noqa: F401
                      TOLERANCE, Result, delta_scale, delta_tolerance, dx_scale_of, fp8_ulps, rel_l2,
                      tolerance)
from .inputs import (_gpu_rng, _inputs, cupy_array, delta_inputs, poisoned_allocations, row_tensor,  # noqa: F401
                     standard_normal, weight_vector)
from .runs import check_knobs, run_case  # noqa: F401
