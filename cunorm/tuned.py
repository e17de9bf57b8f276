"""The sm_90 tuned table: knobs measured fastest per (direction, hidden size,
input element bytes), from before per-GPU tables (cunorm.tables), which dispatch
consults first; new measurements go into those (`cunorm tune`, scripts/tune_table.sh).

(backward, hidden size, input element bytes) -> knobs in cunorm.traits.KNOBS order:
(WARPS_M, WARPS_N, CTAS_PER_ROW, BYTES_PER_LDG, STAGES, CACHE_WEIGHTS, MIN_CTAS_PER_SM, SMEM_ACCUMULATORS
[, RECOMPUTE: default 1]); the comment is the fraction of a same-run device-to-device copy the tuner measured
(M*N = 2^26, weights in the input dtype). 2-byte inputs (bf16 and fp16 share entries): H200, 2026-11-22;
entries marked (H100) were re-tuned on an H100 once persistent grids of 4- and 8-CTA clusters were sized
to the clusters that fit at once (before that, such grids ran a partial second wave, which skewed the choice).
"""

TUNED_ARCH = 90  # measured on sm_90; other architectures use the heuristic

TUNED: dict = {
    (True ,   768, 2): (4, 1, 1, 16, 2, 1, 1, 0),  # 0.90 of copy
    (True ,  1024, 2): (4, 1, 1, 16, 2, 1, 1, 0),  # 0.86 of copy
    (True ,  1536, 2): (1, 2, 1, 16, 2, 1, 1, 0),  # 0.81 of copy
    (True ,  2048, 2): (1, 8, 1, 16, 2, 1, 1, 0),  # 0.81 of copy
    (True ,  2304, 2): (1, 4, 1, 8, 1, 0, 2, 0),  # 0.79 of copy
    (True ,  3072, 2): (1, 4, 1, 16, 2, 1, 2, 0),  # 0.79 of copy
    (True ,  3840, 2): (2, 16, 1, 16, 2, 1, 1, 0),  # 0.74 of copy
    (True ,  4096, 2): (1, 8, 1, 8, 1, 0, 1, 1),  # 0.85 of copy
    (True ,  5120, 2): (2, 8, 1, 8, 1, 0, 1, 1),  # 0.75 of copy
    (True ,  6144, 2): (1, 16, 1, 8, 1, 1, 2, 1),  # 0.80 of copy
    (True ,  8192, 2): (1, 16, 1, 16, 1, 0, 2, 1, 1),  # 0.74 of copy
    (True , 10240, 2): (1, 8, 2, 8, 1, 1, 2, 0),  # 0.63 of copy
    (True , 12288, 2): (1, 16, 2, 8, 1, 1, 2, 1, 1),  # 0.68 of copy
    (False, 12800, 2): (1, 16, 1, 8, 3, 1, 1, 0),  # 0.86 of copy
    (True , 12800, 2): (1, 8, 2, 8, 1, 1, 2, 1),  # 0.65 of copy
    (True , 14336, 2): (1, 32, 2, 16, 2, 1, 1, 0),  # 0.51 of copy
    (False, 15360, 2): (1, 16, 1, 16, 2, 1, 1, 0),  # 0.89 of copy
    (True , 15360, 2): (1, 32, 2, 8, 2, 1, 1, 0),  # 0.53 of copy
    (True , 16384, 2): (1, 16, 2, 8, 1, 1, 2, 1, 0),  # 0.70 of copy
    (False, 18432, 2): (1, 16, 1, 8, 2, 0, 1, 0),  # 0.87 of copy
    (True , 18432, 2): (1, 16, 2, 8, 2, 1, 1, 1),  # 0.55 of copy
    (False, 20480, 2): (1, 32, 1, 8, 2, 1, 1, 0),  # 0.87 of copy
    (True , 20480, 2): (1, 8, 4, 8, 1, 1, 2, 0),  # 0.39 of copy
    (False, 24576, 2): (1, 16, 1, 8, 2, 0, 1, 0),  # 0.83 of copy
    (True , 24576, 2): (1, 8, 4, 8, 2, 1, 2, 1),  # 0.41 of copy
    (False, 25600, 2): (1, 8, 2, 8, 4, 0, 2, 0),  # 0.64 of copy
    (True , 25600, 2): (1, 16, 4, 8, 1, 1, 2, 1, 0),  # 0.76 of copy (H100)
    (False, 30720, 2): (1, 8, 2, 8, 1, 0, 2, 0),  # 0.69 of copy
    (True , 30720, 2): (1, 16, 4, 8, 1, 1, 2, 1, 0),  # 0.80 of copy (H100)
    (False, 32768, 2): (1, 8, 2, 8, 1, 0, 2, 0),  # 0.71 of copy
    (True , 32768, 2): (1, 16, 4, 16, 1, 1, 2, 1, 0),  # 0.78 of copy (H100)
    (False, 40960, 2): (1, 16, 2, 8, 2, 1, 1, 0),  # 0.59 of copy
    (True , 40960, 2): (1, 8, 8, 8, 1, 1, 1, 1),  # 0.34 of copy
    (False, 49152, 2): (1, 4, 8, 8, 2, 0, 1, 0, 1),  # 0.68 of copy (H100)
    (True , 49152, 2): (1, 8, 8, 8, 2, 1, 2, 1),  # 0.37 of copy
    (False, 65536, 2): (1, 4, 8, 8, 2, 1, 1, 0, 1),  # 0.67 of copy (H100)
    (True , 65536, 2): (1, 16, 8, 8, 1, 0, 2, 1, 0),  # 0.77 of copy (H100)
}

# General rows (odd N, offset views, odd row strides) beside an aligned size:
# (backward, aligned neighbour N, input element bytes) -> knobs as above,
# measured at N + 1 (the comment's fraction is at N + 1). 2-byte inputs: H100, 2026-11-22.
TUNED_GENERAL: dict = {
    (False,  4096, 2): (1, 4, 1, 8, 2, 1, 1, 0, 1),  # 0.85 of copy
    (True ,  4096, 2): (1, 4, 1, 8, 1, 0, 1, 1, 0),  # 0.85 of copy
    # The aligned rows' entries before those rows ran unstaged; at N + 1 on an H100 (2026-11-26) the heuristic
    # read 0.58 / 0.62 of copy beside them.
    (False, 12288, 2): (1, 16, 1, 8, 3, 0, 2, 0),  # 0.79 of copy
    (False, 14336, 2): (1, 16, 1, 16, 2, 1, 1, 0),  # 0.79 of copy
    (False, 65536, 2): (1, 16, 4, 8, 1, 0, 2, 0, 1),  # 0.66 of copy
    (True , 65536, 2): (1, 8, 8, 8, 1, 0, 1, 1, 0),  # 0.67 of copy
}
