import numpy as np, cupy, cunorm, sys
from cunorm import check
rng = np.random.default_rng(1)
case = check.Case("layer_norm_backward", 3840, 37, "float32", "float32")
x, w, b = check._inputs(case, rng)
dy = cupy.asarray(rng.standard_normal(x.shape).astype(np.float32))
y_ref, mean_ref, rstd_ref = cunorm.reference.layer_norm(x, w, b)
mean, rstd = mean_ref.astype(np.float32), rstd_ref.astype(np.float32)
for knobs in (None, {"warps_n": 8}, {"warps_n": 4}, {"warps_n": 8, "bytes_per_ldg": 8}, {"warps_n": 2, "warps_m": 2}):
    with check.poisoned_allocations():
        dx, dw, db = cunorm.layer_norm_backward(dy, x, mean, rstd, w, traits=knobs)
    bad = ~cupy.isfinite(dx)
    rows = cupy.unique(cupy.nonzero(bad)[0])
    print(knobs, "bad count", int(bad.sum()), "rows", rows[:20])
    if int(bad.sum()):
        r = int(rows[0]); print("bits", hex(int(dx[r, :4].view(np.uint32)[0])), "dw ok", bool(cupy.isfinite(dw).all()))
