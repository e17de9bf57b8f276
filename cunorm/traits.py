"""Kernel traits of the row-normalization family (LayerNorm and RMSNorm,
forward and backward).

`Traits` mirrors `kernels/norm_traits.cuh` one-to-one: the same independent
knobs and flags, the same derived quantities, and every static_assert of the
kernels re-stated as a ValueError that names the rule (`cunorm.traits_rules`,
which a Traits runs when made), so illegal traits fail in Python before
anything is compiled or launched.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import dtypes, traits_rules


# The independent knobs: launch shape and research levers (what tuning varies and `traits=` may force).
KNOBS = ("warps_m", "warps_n", "ctas_per_row", "bytes_per_ldg", "stages", "cache_weights", "min_ctas_per_sm",
         "smem_accumulators", "recompute", "lanes_per_row", "persistent", "merged_moments", "pushed_exchange",
         "register_sum_steps", "unchecked_whole_steps", "sum_chains", "register_ahead", "stats_ahead")
# What a knob left out takes when others are given (`traits=` mappings, the tuner).
KNOB_DEFAULTS = dict(warps_m=1, warps_n=1, ctas_per_row=1, bytes_per_ldg=16, stages=2, cache_weights=True,
                     min_ctas_per_sm=1, smem_accumulators=False, recompute=True,
                     lanes_per_row=traits_rules.THREADS_PER_WARP, persistent=True, merged_moments=False,
                     pushed_exchange=False, register_sum_steps=0, unchecked_whole_steps=False, sum_chains=1,
                     register_ahead=False, stats_ahead=False)
LATE_DGAMMA_MAX_ELTS = 16  # see Traits.late_dgamma
REFINE_MIN_OFFSET = 4.0  # REFINE_MEAN refines rows whose mean lies this many std or more from zero
# The backward's finalize kernel: warps per CTA (each sums a slice of the partial
# rows), and the CTAs its grid should have at least where rows are narrow (a CTA's
# columns: 4 to 32 lanes side by side, x 4 neighbours, or 1 when N % 4 != 0;
# `Traits.finalize_col_lanes`).
FINALIZE_WARPS = 16
FINALIZE_LEAST_CTAS = 128
DTYPE_FIELDS = ("input_dtype", "weight_dtype", "bias_dtype", "output_dtype", "residual_dtype",
                "residual_out_dtype", "compute_dtype")
OPTIONAL_DTYPE_FIELDS = ("rowscale_dtype", "dx0_dtype", "x1_dtype", "weight1_dtype", "bias1_dtype", "dx1_dtype")


def refines_mean(*, rms: bool, from_output: bool, input_dtype: str, summed_dtypes=()) -> bool:
    """Whether LayerNorm's statistics undo the fp32 rounding of the mean (REFINE_MEAN): fp32 statistics
    (x not float64) on rows of fp32 precision (x, or a dtype summed into the normalized row, fp32); the
    forward adds the mean of h - mean, the backward takes the mean of (x - mean) * rstd off xhat, so that
    rows far from zero mean normalize and differentiate as exactly as centred ones. Half-precision rows cannot hold data far from zero mean
    relative to their spread; float64 x has float64 statistics."""
    return (not rms and not from_output and dtypes.compute_dtype(input_dtype) == "float32"
            and "float32" in (input_dtype, *summed_dtypes))


@dataclass(frozen=True)
class Traits:
    """Independent knobs and flags of one normalization kernel; everything else
    is derived.

    hidden_size: N, the length of a row.
    input_dtype: x (and dx); weight_dtype: gamma (and dgamma); bias_dtype: beta
    (and dbeta); output_dtype: y (and dy); residual_dtype: the residual
    (forward) or dresidual (backward); residual_out_dtype: x + residual as
    stored (forward). Names as in `cunorm.dtypes.NAMES`.
    warps_m: warp rows per CTA (each holds 32 / lanes_per_row rows); warps_n:
      warps across a row;
    ctas_per_row: CTAs sharing a row (a thread-block cluster, sm_90+);
    bytes_per_ldg: bytes one thread moves per vector load of x.
    stages: rows in flight per thread, the current one included; >= 2 stages the
      rows ahead in shared memory with asynchronous copies (no registers held).
    cache_weights: hold gamma/beta in registers for the whole kernel (True) or
      re-read them where used, from L1/L2 (False; frees registers for wide rows).
    min_ctas_per_sm: __launch_bounds__'s second argument: caps registers so that
      this many CTAs fit on an SM (the compiler recomputes instead of holding).
    smem_accumulators: (backward) keep the per-column dgamma/dbeta sums in shared
      memory instead of registers (frees two registers per element).
    register_sum_steps: (backward, smem_accumulators) the column sums of the first
      this many load steps (0 .. ldgs - 1) stay in registers: fewer shared-memory
      loads and stores a row, more registers; one row a CTA, less shared memory too.
    recompute: (backward) recompute xhat and dy * gamma after the row reduction
      (fewer registers) instead of holding them (fewer instructions).
    lanes_per_row: lanes of a warp sharing a row: 32, or 16, 8 or 4 to put
      several rows in each warp (short rows, e.g. q/k heads of 64-256: the
      reductions run over the row's lanes only; warps_n = ctas_per_row = 1).
    persistent: the grid is one wave of CTAs, each walking many row groups
      (True), or (forward, stages == 1) a CTA for every row group, each
      reading its rows straight into registers and exiting (the hardware
      scheduler then overlaps one CTA's reductions with the next one's loads).
    merged_moments: (LayerNorm forward, ctas_per_row > 1) the mean and the squared deviations in one
      exchange across the cluster (each CTA's sum, count, and squared and plain deviations about its own
      mean, merged) instead of the two-pass sums' two (a cluster barrier fewer a row).
    pushed_exchange: (ctas_per_row > 1) each cluster exchange is pushed: every CTA stores its partials into
      each peer's shared memory (st.async) and waits on its own mbarrier for theirs to land, instead of a
      cluster barrier (whose release first waits for the CTA's outstanding global stores) and loads from
      the peers'. Same sums in the same order: the same bits. Needs PTX ISA 8.1 (NVRTC 12.1+).
    unchecked_whole_steps: the load steps in which every thread's vector holds elements of the row
      (`whole_steps`) skip the column check, which then folds away at compile time: fewer instructions, and
      loads the compiler may hoist (often more registers). No effect with full tiles or without whole steps (the
      same code, compiled again under another key). Same arithmetic: the same bits.
    sum_chains: (forward) a thread's row sums (the mean's, the squares') in 1, 2 or 4 independent chains of
      adds, element e of each vector into chain e % sum_chains, added pairwise at the end (at most
      elts_per_ldg): shorter dependent chains where few warps an SM hide the adds' latency, more registers.
      Other chains add in another order: other rounding (the fold keeps subnormal sums of squares).
    register_ahead: (backward, stages 1) a thread loads its next row into registers when it takes
      the current one, so the loads overlap the current row's reduction and stores, where staging in shared
      memory does not fit beside the column sums: a row's vectors more registers a thread. Same arithmetic:
      the same bits.
    stats_ahead: (with register_ahead) the next row's mean and rstd are loaded ahead with its vectors, so the
      row's first use of them does not wait on their loads: two more values a thread (what that costs in
      registers is ptxas's to say). The same bits.
    has_weight / has_bias: whether gamma / beta are present.
    rms: RMSNorm (no mean) rather than LayerNorm; with has_bias, y = xhat * w + b.
    has_residual: forward: x + residual is normalized and stored; backward:
      dresidual is added into dx.
    zero_centered: the weight multiplies as (1 + gamma).
    aligned_rows: every row starts on a vector boundary and is whole vectors
      long (the fast path); otherwise the general kernel reads each row in the
      aligned frame around it and masks the lanes outside the row.
    backward: the backward kernel (dx, dgamma, dbeta) rather than the forward.
    row_axes: 1 (rows one stride apart) or 3 (rows through up to three leading
      axes with their own strides, e.g. q/k views of a fused QKV buffer; aligned
      rows only).
    per_head: weight and bias of shape [heads, N], row r taking head r % heads
      (read where used: cache_weights must be False).
    from_output: (backward) the memory-efficient backward: the row input is
      the forward's output y, xhat = (y - bias) / weight (with has_bias, the
      bias is read too); input_dtype is then y's.
    quant: (forward, fp8 output_dtype) how y is scaled before rounding to fp8:
      "tensor" (a given scale), "row" or "group" (amax / format max per row or
      per 128 columns, stored beside y); "none" otherwise.
    amax: (forward, fp8 output) also store the largest |y| of the call.
    grid_finalize: (backward) the grid, once every CTA has written its
      partial row (a grid-wide barrier: the host launches it cooperatively,
      and keeps its ticket word at 0), sums them into dgamma/dbeta itself,
      instead of norm_bwd_finalize: one launch, for small calls.
    dropout / rowscale_dtype: the branch before the residual add, h = x *
      rowscale * keep / (1 - p) (+ residual): dropout drawn per element from
      a seed (Philox, `reference.dropout_keep`), a scale per row (its dtype;
      None: none). The forward then stores h as residual_out with or
      without a residual (residual_out_dtype is h's); the backward also
      writes dx0, the branch input's gradient.
    dropout_mask: (forward, with dropout) also store the keep mask.
    dx0_dtype: (backward, with a branch) dx0's dtype.
    x1_dtype: (forward) the parallel branch x1, summed into h (dropped out
      with its own mask; h is stored as residual_out); None: none.
    weight1_dtype / bias1_dtype: a second weight (and bias) giving a second
      output y1 = xhat * w1 (+ b1) from the same statistics (y1 in
      output_dtype); the backward reads dy1 (output_dtype) and sums dweight1
      (and dbias1). None: none.
    dx1_dtype: (backward, with x1 and dropout) dx1's dtype (x1's gradient;
      without dropout it is dx).
    """

    hidden_size: int
    input_dtype: str = "float32"
    weight_dtype: str | None = None  # None: input_dtype for a tensor present (float32 for an absent one)
    output_dtype: str | None = None
    bias_dtype: str | None = None
    residual_dtype: str | None = None
    residual_out_dtype: str | None = None
    compute_dtype: str | None = None  # derived: float64 for float64 x, else float32 (dtypes.compute_dtype)
    # Knobs: None means not given. With none given, all come from the heuristic dispatch uses for such a
    # call (legal by construction); with some given, the others take KNOB_DEFAULTS.
    warps_m: int | None = None
    warps_n: int | None = None
    ctas_per_row: int | None = None
    bytes_per_ldg: int | None = None
    stages: int | None = None
    cache_weights: bool | None = None
    min_ctas_per_sm: int | None = None
    smem_accumulators: bool | None = None
    recompute: bool | None = None
    lanes_per_row: int | None = None
    persistent: bool | None = None
    merged_moments: bool | None = None
    pushed_exchange: bool | None = None
    register_sum_steps: int | None = None
    unchecked_whole_steps: bool | None = None
    sum_chains: int | None = None
    register_ahead: bool | None = None
    stats_ahead: bool | None = None
    has_weight: bool = True
    has_bias: bool = True
    rms: bool = False
    has_residual: bool = False
    zero_centered: bool = False
    aligned_rows: bool = True
    backward: bool = False
    row_axes: int = 1
    per_head: bool = False
    from_output: bool = False
    quant: str = "none"
    amax: bool = False
    grid_finalize: bool = False
    dropout: bool = False
    rowscale_dtype: str | None = None
    dropout_mask: bool = False
    dx0_dtype: str | None = None
    x1_dtype: str | None = None
    weight1_dtype: str | None = None
    bias1_dtype: str | None = None
    dx1_dtype: str | None = None

    KNOBS = KNOBS  # what `traits=` may force and tuning varies

    def __post_init__(self):
        object.__setattr__(self, "input_dtype", dtypes.name_of(self.input_dtype))
        for field in OPTIONAL_DTYPE_FIELDS:  # None, or a name
            if getattr(self, field) is not None:
                object.__setattr__(self, field, dtypes.name_of(getattr(self, field)))
        if self.compute_dtype is None:
            object.__setattr__(self, "compute_dtype", dtypes.compute_dtype(self.input_dtype))
        # Dtypes left out: x's for the tensors present; float32 for absent ones (what a call names for them).
        present = dict(weight_dtype=self.has_weight, bias_dtype=self.has_bias, residual_dtype=self.has_residual,
                       residual_out_dtype=self.has_residual and not self.backward)
        for field in DTYPE_FIELDS:
            value = getattr(self, field)
            if value is None:
                value = self.input_dtype if present.get(field, True) else "float32"
            object.__setattr__(self, field, dtypes.name_of(value))
        if all(getattr(self, k) is None for k in KNOBS):
            from .heuristic import heuristic  # the heuristic builds on this module

            rest = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in KNOBS}
            derived = heuristic(**{k: v for k, v in rest.items() if k != "aligned_rows"},
                                aligned_rows=self.aligned_rows)
            for k in KNOBS:
                object.__setattr__(self, k, getattr(derived, k))
        for k in KNOBS:
            if getattr(self, k) is None:
                object.__setattr__(self, k, KNOB_DEFAULTS[k])
            elif isinstance(KNOB_DEFAULTS[k], bool) and getattr(self, k) in (0, 1):
                # The literal table's 0/1 flags as bools: knobs() is what tables save, and a table reads
                # flags as true or false only.
                object.__setattr__(self, k, bool(getattr(self, k)))
        self._check()

    # -- derived, as in norm_traits.cuh ------------------------------------
    @property
    def branch(self) -> bool:
        """Dropout or a row scale before the residual add."""
        return self.dropout or self.rowscale_dtype is not None

    @property
    def stores_h(self) -> bool:
        """(forward) Whether h is stored as residual_out (STORES_H): with a residual, a branch or x1."""
        return not self.backward and (self.has_residual or self.branch or self.x1_dtype is not None)

    @property
    def late_dgamma(self) -> bool:
        """(backward) LATE_DGAMMA: LayerNorm's dgamma column sums taken after the row reduction, in the loop
        that writes dx (fewer values live across the reduction; 0.5-1.5% faster at 8192-32768 on an H100,
        1.4% slower at 65536): fp32 x in aligned rows of 16-byte vectors, up to LATE_DGAMMA_MAX_ELTS a
        thread, xhat from x, no dropout, row scale or x1 (with those and narrower vectors its capped
        kernels can spill). dgamma_after_reduction adds REFINE_MEAN's backwards, without the register cap."""
        return (self.backward and not self.rms and not self.from_output and self.aligned_rows
                and self.input_dtype == "float32" and self.elts_per_thread <= LATE_DGAMMA_MAX_ELTS
                and self.elts_per_ldg == 4 and not self.branch and self.dx1_dtype is None)

    @property
    def dgamma_after_reduction(self) -> bool:
        """(backward) The kernel's LATE_DGAMMA: late_dgamma's calls, and REFINE_MEAN's, whose xhat is known only
        after the row reduction (it takes the mean of xhat off; a GATED kernel's plain loop, which no refined
        row takes, sums dgamma before the reduction)."""
        return self.late_dgamma or (self.backward and self.refine_mean)

    @property
    def refine_mean(self) -> bool:
        """REFINE_MEAN (see refines_mean): x fp32, or in the forward a residual or x1 that is. The backward
        sums x - mean beside its row sums, and on rows far from zero mean takes the mean of xhat off xhat."""
        summed = []
        if not self.backward:
            summed += [self.residual_dtype] if self.has_residual else []
            summed += [self.x1_dtype] if self.x1_dtype is not None else []
        return refines_mean(rms=self.rms, from_output=self.from_output, input_dtype=self.input_dtype,
                            summed_dtypes=summed)

    @property
    def parallel(self) -> bool:
        """A second output y1 from a second weight."""
        return self.weight1_dtype is not None

    @property
    def column_sums(self) -> int:
        """(backward) Column-sum quantities a CTA keeps: dgamma and dbeta, and dgamma1 and dbeta1 (parallel)."""
        return 4 if self.parallel else 2

    @property
    def threads_per_row(self) -> int:
        return self.warps_n * self.lanes_per_row

    @property
    def rows_per_warp(self) -> int:
        return traits_rules.THREADS_PER_WARP // self.lanes_per_row

    @property
    def rows_per_cta(self) -> int:
        return self.warps_m * self.rows_per_warp

    @property
    def threads_per_cta(self) -> int:
        return self.warps_m * self.warps_n * traits_rules.THREADS_PER_WARP

    @property
    def register_cap(self) -> int:
        """Registers a thread may take under MIN_CTAS_PER_SM (before ptxas rounds it down)."""
        return traits_rules.REGISTERS_PER_SM // (self.min_ctas_per_sm * self.threads_per_cta)

    @property
    def elts_per_ldg(self) -> int:
        return self.bytes_per_ldg // dtypes.itemsize(self.input_dtype)

    @property
    def vec_cols(self) -> int:
        """Vectors a row touches: N / E aligned; shifted rows up to one more."""
        e = self.elts_per_ldg
        return self.hidden_size // e if self.aligned_rows else (self.hidden_size + 2 * e - 2) // e

    @property
    def vec_cols_per_ldg(self) -> int:
        return self.ctas_per_row * self.threads_per_row

    @property
    def ldgs(self) -> int:
        return -(-self.vec_cols // self.vec_cols_per_ldg)

    @property
    def register_words(self) -> int:
        """Registers one element of a row takes in the arithmetic (2 for fp64)."""
        return dtypes.itemsize(self.compute_dtype) // 4

    @property
    def max_elts_per_thread(self) -> int:
        """The register budget in elements. The general kernel may go one vector
        over it: a shifted row touches one vector more than its length, and
        without that allowance an odd size could not run its aligned
        neighbour's launch shape (65537 beside 65536: 17 load steps, not 16)."""
        over = 0 if self.aligned_rows else self.elts_per_ldg
        return traits_rules.MAX_ELTS_PER_THREAD // self.register_words + over

    @property
    def elts_per_thread(self) -> int:
        return self.ldgs * self.elts_per_ldg

    @property
    def full_tiles(self) -> bool:
        return self.aligned_rows and self.vec_cols % self.vec_cols_per_ldg == 0

    @property
    def whole_steps(self) -> int:
        """Load steps in which every thread's vector holds elements of the row, whatever the shift (all of them
        with full tiles): aligned, whole steps of vectors; shifted, those ending by N // E vectors (one step short
        of the exact count where N % E != 0 and ceil(N / E) is a multiple of a step's vectors)."""
        e, per_step = self.elts_per_ldg, self.vec_cols_per_ldg
        return self.vec_cols // per_step if self.aligned_rows else self.hidden_size // e // per_step

    def _vec_bytes(self, dtype: str) -> int:
        """sizeof(Vec<T, ELTS_PER_LDG>): at least one 32-bit word (a lone 16-bit element takes its low half)."""
        return max(4, self.elts_per_ldg * dtypes.itemsize(dtype))

    def _pipe_bytes(self, dtype: str) -> int:
        return self.stages * self.stage_slots * self._vec_bytes(dtype) if self.stages > 1 else 0

    def _weight_slot_bytes(self, dtype: str) -> int:
        """A weight kept in shared-memory slots (general kernel, not cached in registers)."""
        in_smem = not self.cache_weights and not self.aligned_rows and not self.per_head
        return self.stage_slots * self._vec_bytes(dtype) if in_smem else 0

    @property
    def staged_dtypes(self) -> tuple:
        """Dtypes of the row tensors read through the row pipeline."""
        first = ("input_dtype", "output_dtype") if self.backward else ("input_dtype",)
        names = first + (("residual_dtype",) if self.has_residual else ())
        if self.backward and self.parallel:
            names += ("output_dtype",)  # dy1
        elif not self.backward and self.x1_dtype is not None:
            names += ("x1_dtype",)
        return tuple(getattr(self, n) for n in names)

    @property
    def holds_two_rows(self) -> bool:
        return self.backward or self.has_residual or self.x1_dtype is not None

    @property
    def stage_slots(self) -> int:
        return self.rows_per_cta * self.ldgs * self.threads_per_row

    @property
    def sum_slot_steps(self) -> int:
        """(backward) Load steps whose column sums have shared-memory slots (SLOT_STEPS): all, but those of
        register_sum_steps where a CTA holds one row (their sums go straight to the partial row)."""
        return self.ldgs - (self.register_sum_steps if self.rows_per_cta == 1 else 0)  # (0 without smem sums)

    @property
    def smem_bytes(self) -> int:
        """Dynamic shared memory: staged rows ([STAGES][ROWS_PER_CTA][LDGS][THREADS_PER_ROW]
        vectors of every staged row tensor), weights kept in shared-memory slots
        ([ROWS_PER_CTA][LDGS][THREADS_PER_ROW] vectors), and, in the backward, the
        column-sum slots (2 x [ROWS_PER_CTA][sum_slot_steps][THREADS_PER_ROW] compute_t vectors)
        when the sums live there or ROWS_PER_CTA rows must be folded (4 x with a second weight)."""
        staged = sum(self._pipe_bytes(d) for d in self.staged_dtypes)
        second = [self.weight1_dtype] if self.parallel else []  # the second weight (and bias), after the first
        if self.backward:
            folds = self.smem_accumulators or self.rows_per_cta > 1
            sums = (self.column_sums * self.rows_per_cta * self.sum_slot_steps * self.threads_per_row
                    * self.elts_per_ldg * dtypes.itemsize(self.compute_dtype) if folds else 0)
            weights = self._weight_slot_bytes(self.weight_dtype) if self.has_weight else 0
            if self.from_output and self.has_bias:  # the bias is read to recover xhat
                weights += self._weight_slot_bytes(self.bias_dtype)
            return sums + staged + weights + sum(map(self._weight_slot_bytes, second))
        second += [self.bias1_dtype] if self.bias1_dtype is not None else []
        weights = ((self._weight_slot_bytes(self.weight_dtype) if self.has_weight else 0)
                   + (self._weight_slot_bytes(self.bias_dtype) if self.has_bias else 0))
        return staged + weights + sum(map(self._weight_slot_bytes, second))

    @property
    def row_sums(self) -> int:
        """The row reduction's quantities (RowReducer's K): the backward's SUMS (sum(g) for LayerNorm,
        sum(g * xhat), REFINE_MEAN's sum(x - mean)); the forward's 1, or 4 with merged moments."""
        if self.backward:
            return (1 if self.rms else 2) + self.refine_mean
        return 4 if self.merged_moments else 1

    @property
    def static_smem_bytes(self) -> int:
        """The main kernel's static shared memory, at most: each RowReducer's scratch as CN_ROW_REDUCER_OF
        declares it (warp partials [2][WARPS_M][WARPS_N][K], a parity's CTA partials [2 * SENDERS][EVEN_K],
        two mbarriers), plus the row max of fp8 per-row scaling. The compiler drops what a shape leaves
        unused (one-CTA rows: the CTA slots), so it may hold less. Counted with `smem_bytes` against the
        GPU's per-CTA limit: a launch whose sum passes it is refused by the driver."""
        compute = dtypes.itemsize(self.compute_dtype)
        senders = self.ctas_per_row if self.pushed_exchange else 1

        def aligned(nbytes: int) -> int:  # the CTA slots are __align__(16): the arrays before them pad to it
            return -(-nbytes // 16) * 16

        def reducer(k: int) -> int:
            even_k = k + (k & 1) if k > 1 else 1
            return aligned(2 * self.warps_m * self.warps_n * k * compute) + aligned(2 * senders * even_k * compute) + 16

        return reducer(self.row_sums) + (reducer(1) if self.quant == "row" else 0)

    @property
    def smem_footprint(self) -> int:
        """Shared memory a CTA of the main kernel takes, at most (dynamic and static): what the GPU's per-CTA
        limit bounds."""
        return self.smem_bytes + self.static_smem_bytes

    @property
    def source_file(self) -> str:
        """The kernels/ file these traits render."""
        return "norm_bwd.cu" if self.backward else "norm_fwd.cu"

    @property
    def finalize_vec(self) -> int:
        """Neighbouring columns a finalize lane sums (one vector load a partial row): the kernel's FIN_VEC."""
        return 4 if self.hidden_size % 4 == 0 else 1

    @property
    def finalize_col_lanes(self) -> int:
        """Lanes of a finalize warp side by side along the row (the warp's others sum other partial rows):
        the most of 32, 16, 8 that leaves FINALIZE_LEAST_CTAS CTAs, else 4 (docs/PERFORMANCE.md, version 66)."""
        vecs = self.hidden_size // self.finalize_vec
        return next((lanes for lanes in (32, 16, 8) if vecs >= lanes * FINALIZE_LEAST_CTAS), 4)

    @property
    def finalize_cols_per_cta(self) -> int:
        return self.finalize_col_lanes * self.finalize_vec

    def launches(self) -> dict:
        """{kernel name: (threads per CTA, dynamic shared memory bytes, CTAs per
        cluster)} for the extern "C" kernels of source_file."""
        if self.backward:
            main = {"norm_bwd": (self.threads_per_cta, self.smem_bytes, self.ctas_per_row)}
            return main if self.grid_finalize else {
                **main, "norm_bwd_finalize": (FINALIZE_WARPS * traits_rules.THREADS_PER_WARP, 0, 1)}
        return {"norm_fwd": (self.threads_per_cta, self.smem_bytes, self.ctas_per_row)}

    @property
    def uses_cluster(self) -> bool:
        return self.ctas_per_row > 1

    # -- the kernels' static_asserts (cunorm.traits_rules) ------------------
    def _check(self):
        traits_rules.check(self)

    def check_arch(self, arch: int):
        """Rules that depend on the GPU: sm_80 or newer; clusters need sm_90; shared memory within the GPU's
        per-CTA limit (traits_rules.check_arch)."""
        traits_rules.check_arch(self, arch)

    # -- presentation -------------------------------------------------------
    def replace(self, **changes) -> "Traits":
        return dataclasses.replace(self, **changes)

    def short(self) -> str:
        flags = "".join(f" {name}" for name, on in (("rms", self.rms), ("residual", self.has_residual),
                                                     ("zero-centered", self.zero_centered),
                                                     ("general", not self.aligned_rows),
                                                     ("3-axis-rows", self.row_axes == 3),
                                                     ("per-head-weights", self.per_head),
                                                     ("from-output", self.from_output),
                                                     (f"fp8-scaled-per-{self.quant}", self.quant != "none"),
                                                     ("amax", self.amax),
                                                     ("grid-finalize", self.grid_finalize),
                                                     ("dropout", self.dropout),
                                                     (f"rowscale={self.rowscale_dtype}",
                                                      self.rowscale_dtype is not None),
                                                     ("dropout-mask", self.dropout_mask),
                                                     (f"dx0={self.dx0_dtype}", self.dx0_dtype is not None),
                                                     (f"x1={self.x1_dtype}", self.x1_dtype is not None),
                                                     (f"weight1={self.weight1_dtype}", self.parallel),
                                                     (f"bias1={self.bias1_dtype}", self.bias1_dtype is not None),
                                                     (f"dx1={self.dx1_dtype}", self.dx1_dtype is not None)) if on)
        if self.has_residual:  # the residual read and residual_out written: two tensors, a dtype each
            flags += (f" dresidual={self.residual_dtype}" if self.backward else
                      f" residual={self.residual_dtype}->{self.residual_out_dtype}")
        return (f"N={self.hidden_size} {self.input_dtype}/{self.weight_dtype}->{self.output_dtype}{flags} "
                f"WARPS_M={self.warps_m} WARPS_N={self.warps_n} CTAS_PER_ROW={self.ctas_per_row} "
                f"BYTES_PER_LDG={self.bytes_per_ldg} STAGES={self.stages} CACHE_WEIGHTS={int(self.cache_weights)} "
                f"MIN_CTAS_PER_SM={self.min_ctas_per_sm}" + (" SMEM_ACCUMULATORS=1" if self.smem_accumulators else "")
                + ("" if self.recompute else " RECOMPUTE=0")
                + ("" if self.lanes_per_row == traits_rules.THREADS_PER_WARP
                   else f" LANES_PER_ROW={self.lanes_per_row}")
                + ("" if self.persistent else " PERSISTENT=0") + (" MERGED_MOMENTS=1" if self.merged_moments else "")
                + (" PUSHED_EXCHANGE=1" if self.pushed_exchange else "")
                + (f" REGISTER_SUM_STEPS={self.register_sum_steps}" if self.register_sum_steps else "")
                + (" UNCHECKED_WHOLE_STEPS=1" if self.unchecked_whole_steps else "")
                + (f" SUM_CHAINS={self.sum_chains}" if self.sum_chains != 1 else "")
                + (" REGISTER_AHEAD=1" if self.register_ahead else "")
                + (" STATS_AHEAD=1" if self.stats_ahead else ""))

    def knobs(self) -> dict:
        return {k: getattr(self, k) for k in KNOBS}

    def as_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.update(threads_per_cta=self.threads_per_cta, ldgs=self.ldgs, elts_per_thread=self.elts_per_thread,
                 smem_bytes=self.smem_bytes)
        return d

    def template_values(self) -> dict:
        """Placeholder values for kernels/norm_traits.cuh."""
        return {
            "INPUT_T": dtypes.cxx_type(self.input_dtype),
            "WEIGHT_T": dtypes.cxx_type(self.weight_dtype),
            "BIAS_T": dtypes.cxx_type(self.bias_dtype),
            "OUTPUT_T": dtypes.cxx_type(self.output_dtype),
            "RESIDUAL_T": dtypes.cxx_type(self.residual_dtype),
            "RESIDUAL_OUT_T": dtypes.cxx_type(self.residual_out_dtype),
            "COMPUTE_T": dtypes.cxx_type(self.compute_dtype),
            "HIDDEN_SIZE": self.hidden_size,
            "WARPS_M": self.warps_m,
            "WARPS_N": self.warps_n,
            "LANES_PER_ROW": self.lanes_per_row,
            "CTAS_PER_ROW": self.ctas_per_row,
            "BYTES_PER_LDG": self.bytes_per_ldg,
            "HAS_WEIGHT": "true" if self.has_weight else "false",
            "HAS_BIAS": "true" if self.has_bias else "false",
            "RMS": "true" if self.rms else "false",
            "HAS_RESIDUAL": "true" if self.has_residual else "false",
            "ZERO_CENTERED": "true" if self.zero_centered else "false",
            "LATE_DGAMMA": "true" if self.dgamma_after_reduction else "false",
            "REFINE_MEAN": "true" if self.refine_mean else "false",
            "MERGED_MOMENTS": "true" if self.merged_moments else "false",
            "PUSHED_EXCHANGE": "true" if self.pushed_exchange else "false",
            "REFINE_MIN_OFFSET": f"{REFINE_MIN_OFFSET!r}f",
            "ALIGNED_ROWS": "true" if self.aligned_rows else "false",
            "ROW_AXES": self.row_axes,
            "PER_HEAD": int(self.per_head),
            "CACHE_WEIGHTS": "true" if self.cache_weights else "false",
            "MIN_CTAS_PER_SM": self.min_ctas_per_sm,
            "STAGES": self.stages,
            "PERSISTENT": "true" if self.persistent else "false",
            "SMEM_ACCUMULATORS": "true" if self.smem_accumulators else "false",
            "RECOMPUTE": "true" if self.recompute else "false",
            "REGISTER_SUM_STEPS": self.register_sum_steps,
            "UNCHECKED_WHOLE_STEPS": "true" if self.unchecked_whole_steps else "false",
            "SUM_CHAINS": self.sum_chains,
            "REGISTER_AHEAD": "true" if self.register_ahead else "false",
            "STATS_AHEAD": "true" if self.stats_ahead else "false",
            "FROM_OUTPUT": int(self.from_output),
            "QUANT": traits_rules.QUANT_MODES.index(self.quant),
            "AMAX": int(self.amax),
            "GRID_FINALIZE": int(self.grid_finalize),
            "BRANCH": int(self.branch),
            "DROPOUT": "true" if self.dropout else "false",
            "ROWSCALE": "true" if self.rowscale_dtype is not None else "false",
            "ROWSCALE_T": dtypes.cxx_type(self.rowscale_dtype or "float32"),
            "DROPOUT_MASK": "true" if self.dropout_mask else "false",
            "DX0_T": dtypes.cxx_type(self.dx0_dtype or "float32"),
            "X1": int(self.x1_dtype is not None),
            "X1_T": dtypes.cxx_type(self.x1_dtype or "float32"),
            "PARALLEL": int(self.parallel),
            "WEIGHT1_T": dtypes.cxx_type(self.weight1_dtype or "float32"),
            "HAS_BIAS1": "true" if self.bias1_dtype is not None else "false",
            "BIAS1_T": dtypes.cxx_type(self.bias1_dtype or "float32"),
            "DX1": int(self.dx1_dtype is not None),
            "DX1_T": dtypes.cxx_type(self.dx1_dtype or "float32"),
            "LDGS": self.ldgs,
            "WHOLE_STEPS": self.whole_steps,
            "THREADS_PER_CTA": self.threads_per_cta,
            "ELTS_PER_THREAD": self.elts_per_thread,
            "SMEM_BYTES": self.smem_bytes,
            "FINALIZE_WARPS": FINALIZE_WARPS,
            "FINALIZE_COLS_PER_CTA": self.finalize_cols_per_cta,
            "FINALIZE_COL_LANES": self.finalize_col_lanes,
        }

