"""cunorm.torch: drop-in modules, autograd, torch.compile, CUDA graphs.

Tier A (torch on the CPU: the ops run the float64 reference through numpy)
checks semantics: parity with torch.nn, state_dict, replace_norms, gradcheck,
a fullgraph trace. Tier C (`gpu`) runs the same checks on the kernels, plus
compile with inductor, CUDA-graph capture and replay, a non-default stream
and a short training run. Without torch every test here is skipped (reason
printed)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (pip install 'cunorm[torch]')")
ct = pytest.importorskip("cunorm.torch")

nn = torch.nn


def _cuda_ready():
    from conftest import gpu_available

    return gpu_available() is None and torch.cuda.is_available()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [(torch.float32, None), (torch.float16, None), (torch.bfloat16, None), (torch.bfloat16, torch.float32)]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _pair(kind, shape, device, param_dtype, **kw):
    """A cunorm module and the torch.nn module it replaces, same random parameters."""
    native = (nn.LayerNorm if kind == "layer" else nn.RMSNorm)(shape, device=device, dtype=param_dtype, **kw)
    ours = (ct.LayerNorm if kind == "layer" else ct.RMSNorm)(shape, device=device, dtype=param_dtype, **kw)
    with torch.no_grad():
        for p in native.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + 1)
    ours.load_state_dict(native.state_dict())
    return ours, native


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,param_dtype", DTYPES)
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("shape,options", [(1000, {}), ((4, 96), {}), (1024, {"elementwise_affine": False}),
                                           (768, {"bias": False})])
def test_parity_with_torch_nn_against_float64_autograd(kind, shape, options, dtype, param_dtype, device):
    """Forward and backward (dx, dweight, dbias) against float64 autograd of
    the torch.nn module, within the tolerance of the input dtype."""
    if kind == "rms" and "bias" in options:
        options = {}
    if device == "cuda" and not _cuda_ready():
        pytest.fail("no usable CUDA GPU for a gpu test")
    torch.manual_seed(0)
    ours, native = _pair(kind, shape, device, param_dtype or dtype, eps=1e-5, **options)
    lead = (3, 37)
    dims = (shape,) if isinstance(shape, int) else shape
    x = (torch.randn(*lead, *dims, device=device) + 2).to(dtype).requires_grad_()
    dy = torch.randn(*lead, *dims, device=device).to(dtype)
    y = ours(x)
    assert y.dtype == dtype and y.shape == x.shape
    y.backward(dy)
    ref = native.double()
    x64 = x.detach().double().requires_grad_()
    y64 = ref(x64)
    y64.backward(dy.double())
    assert _rel(y, y64) < TOL[dtype]
    assert _rel(x.grad, x64.grad) < TOL[dtype]
    for p, p64 in zip(ours.parameters(), ref.parameters()):
        assert p.grad is not None and p.grad.dtype == p.dtype
        assert _rel(p.grad, p64.grad) < TOL[p.dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_residual_zero_centered_and_out_dtype(device):
    """forward(x, residual) -> (y, residual_out), gradients reaching both x
    and the residual; 1 + w; out_dtype; against float64 autograd."""
    if device == "cuda" and not _cuda_ready():
        pytest.fail("no usable CUDA GPU for a gpu test")
    torch.manual_seed(1)
    m = ct.RMSNorm(512, eps=1e-6, device=device, zero_centered_weight=True, residual_dtype=torch.float32,
                   out_dtype=torch.float32)
    with torch.no_grad():
        m.weight.normal_(0, 0.3)
    x = torch.randn(64, 512, device=device, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(64, 512, device=device, dtype=torch.bfloat16, requires_grad=True)
    y, h = m(x, r)
    assert y.dtype == torch.float32 and h.dtype == torch.float32
    dy, dh = torch.randn_like(y), torch.randn_like(h)
    torch.autograd.backward([y, h], [dy, dh])
    x64, r64 = (t.detach().double().requires_grad_() for t in (x, r))
    w64 = m.weight.detach().double().requires_grad_()
    h64 = x64 + r64
    y64 = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w64)
    torch.autograd.backward([y64, h64], [dy.double(), dh.double()])
    assert _rel(h, h64) < 1e-7 and _rel(y, y64) < 2e-5
    assert _rel(x.grad, x64.grad) < 1.6e-2 and _rel(r.grad, r64.grad) < 1.6e-2
    assert _rel(m.weight.grad, w64.grad) < 2e-5


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")
def test_gradcheck_fp32():
    """torch.autograd.gradcheck of the functional forms in fp32 (finite differences are loose)."""
    torch.manual_seed(2)
    x = torch.randn(4, 24, requires_grad=True)
    w = torch.randn(24, requires_grad=True)
    b = torch.randn(24, requires_grad=True)
    r = torch.randn(4, 24, requires_grad=True)
    kw = dict(eps=1e-2, atol=2e-2, rtol=2e-2, nondet_tol=1e-6)
    assert torch.autograd.gradcheck(lambda a, g, c: ct.layer_norm(a, None, g, c), (x, w, b), **kw)
    assert torch.autograd.gradcheck(lambda a, g: ct.rms_norm(a, None, g, 1e-5), (x, w), **kw)
    assert torch.autograd.gradcheck(lambda a, q, g: ct.rms_norm(a, None, g, 1e-5, residual=q), (x, r, w), **kw)


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")
def test_gradcheck_fp64():
    """gradcheck at its default (tight) tolerances: float64 runs in float64 end to end."""
    torch.manual_seed(3)
    x, r = (torch.randn(4, 24, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w, b = (torch.randn(24, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda a, g, c: ct.layer_norm(a, None, g, c), (x, w, b))
    assert torch.autograd.gradcheck(lambda a, q, g: ct.rms_norm(a, None, g, 1e-5, residual=q), (x, r, w))
    assert torch.autograd.gradcheck(lambda a, q, g, c: ct.layer_norm(a, None, g, c, residual=q), (x, r, w, b))
    assert torch.autograd.gradcheck(lambda a, g, c: ct.rms_norm(a, None, g, 1e-5, bias=c), (x, w, b))


def test_state_dict_and_reset_parameters_match_torch():
    for ours, native in ((ct.LayerNorm((3, 8)), nn.LayerNorm((3, 8))), (ct.RMSNorm(8), nn.RMSNorm(8)),
                         (ct.LayerNorm(8, bias=False), nn.LayerNorm(8, bias=False)),
                         (ct.LayerNorm(8, elementwise_affine=False), nn.LayerNorm(8, elementwise_affine=False))):
        assert ours.state_dict().keys() == native.state_dict().keys()
        for (k, a), b in zip(ours.state_dict().items(), native.state_dict().values()):
            assert torch.equal(a, b), k
        ours.load_state_dict(native.state_dict())
        assert ours.normalized_shape == native.normalized_shape and ours.eps == native.eps
    z = ct.RMSNorm(8, zero_centered_weight=True)
    assert torch.equal(z.weight, torch.zeros(8))  # the multiplier is 1 + weight


def test_replace_norms_keeps_parameters_and_eps():
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, eps=1e-3), nn.Sequential(nn.RMSNorm(8, eps=1e-4)),
                          nn.LayerNorm(8, elementwise_affine=False))
    params = [model[1].weight, model[1].bias, model[2][0].weight]
    replaced = ct.replace_norms(model)
    assert sorted(name for name, _ in replaced) == ["1", "2.0", "3"]
    assert isinstance(model[1], ct.LayerNorm) and isinstance(model[2][0], ct.RMSNorm)
    assert model[1].weight is params[0] and model[1].bias is params[1] and model[2][0].weight is params[2]
    assert model[1].eps == 1e-3 and model[2][0].eps == 1e-4 and model[3].weight is None
    assert ct.replace_norms(model) == []  # nothing left to replace

    class Custom(nn.Module):  # a norm of another library, wrapped by a converter
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(8))
            self.variance_epsilon = 1e-6

    def convert(m):
        new = ct.RMSNorm(8, eps=m.variance_epsilon, zero_centered_weight=True)
        new.weight = m.weight
        return new

    holder = nn.Sequential(Custom())
    assert len(ct.replace_norms(holder, {Custom: convert})) == 1 and isinstance(holder[0], ct.RMSNorm)


def test_fullgraph_trace_through_the_custom_ops():
    """torch.compile(fullgraph=True) traces the modules without graph breaks
    (aot_eager on the CPU: the fake implementations and the autograd formula)."""
    torch._dynamo.reset()
    block = _Block(64)
    x = torch.randn(8, 64, requires_grad=True)
    r = torch.randn(8, 64, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    _same_outputs_and_grads(block, compiled, x, r, tol=0.0)


class _Block(nn.Module):
    """A pre-norm block: residual add + RMSNorm, a linear, LayerNorm."""

    def __init__(self, n, device=None, dtype=None):
        super().__init__()
        self.norm = ct.RMSNorm(n, device=device, dtype=dtype)
        self.lin = nn.Linear(n, n, device=device, dtype=dtype)
        self.out = ct.LayerNorm(n, device=device, dtype=dtype)

    def forward(self, x, residual):
        y, h = self.norm(x, residual)
        return self.out(self.lin(y)), h


def _same_outputs_and_grads(eager, compiled, x, r, tol):
    outs, grads = [], []
    for model in (eager, compiled):
        for t in (x, r, *model.parameters()):
            t.grad = None
        y, h = model(x, r)
        (y.float().square().sum() + h.float().sum()).backward()
        outs.append((y.detach(), h.detach()))
        grads.append([t.grad.clone() for t in (x, r, *eager.parameters())])
    for a, b in zip(outs[0], outs[1]):
        assert _rel(a, b) <= tol
    for a, b in zip(*grads):
        assert _rel(a, b) <= max(tol, 1e-6)


def test_attention_delta_cpu():
    o, g = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    d = ct.attention_delta(o, g)
    assert d.dtype == torch.float32 and _rel(d, (o.double() * g.double()).sum(-1)) < 1e-6


# -- tier C: the kernels under torch -----------------------------------------------

@pytest.mark.gpu
def test_compile_inductor_matches_eager():
    torch._dynamo.reset()
    torch.manual_seed(3)
    block = _Block(1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(256, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True)
    _same_outputs_and_grads(block, compiled, x, r, tol=1e-2)


class _Norms(nn.Module):
    """Only cunorm ops (a residual RMSNorm into a LayerNorm), so that results
    can be compared bit for bit (cuBLAS may pick other kernels under capture)."""

    def __init__(self, n, device=None, dtype=None):
        super().__init__()
        self.norm = ct.RMSNorm(n, device=device, dtype=dtype)
        self.out = ct.LayerNorm(n, device=device, dtype=dtype)
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(1.0, 0.2)

    def forward(self, x, residual):
        y, h = self.norm(x, residual)
        return self.out(y * 2.0), h


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay():
    """Forward and backward captured once, replayed after the inputs'
    contents change: the same results as eager, bit for bit."""
    torch.manual_seed(4)
    block = _Norms(2048, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(128, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(128, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def step():
        for t in (x, r, *block.parameters()):
            t.grad = None
        y, h = block(x, r)
        (y.float().square().sum() + h.float().sum()).backward()
        return y, h

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up: compile and plan outside the capture
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    for t in (x, r, *block.parameters()):
        t.grad = None
    with torch.cuda.graph(g):
        y_static, h_static = step()
    grads = [x.grad, r.grad, block.norm.weight.grad, block.out.weight.grad, block.out.bias.grad]
    for _ in range(3):
        with torch.no_grad():
            x.copy_(torch.randn_like(x))
            r.copy_(torch.randn_like(r))
        g.replay()
        torch.cuda.synchronize()
        got = [t.clone() for t in [y_static, h_static] + grads]
        y, h = step()
        want = [y, h, x.grad, r.grad, block.norm.weight.grad, block.out.weight.grad, block.out.bias.grad]
        for a, b in zip(got, want):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_non_default_stream_is_bitwise_equal():
    torch.manual_seed(5)
    block = _Block(4096, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    results = []
    for stream in (None, torch.cuda.Stream()):
        for t in (x, r, *block.parameters()):
            t.grad = None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(torch.cuda.current_stream()):
            y, h = block(x, r)
            (y.float().square().sum() + h.float().sum()).backward()
        torch.cuda.synchronize()
        results.append([y, h, x.grad, r.grad] + [p.grad for p in block.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def _tiny_transformer(norm: str, seed: int, device="cuda"):
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.0, batch_first=True, norm_first=True, device=device)
    model = nn.Sequential(nn.Embedding(512, 256, device=device), nn.TransformerEncoder(layer, 2,
                                                                                         enable_nested_tensor=False),
                          nn.LayerNorm(256, device=device), nn.Linear(256, 512, device=device))
    if norm == "cunorm":
        assert len(ct.replace_norms(model)) == 5  # two per layer, and the final one
    return model


@pytest.mark.gpu
def test_training_matches_native_loss_curve():
    """50 steps of a small torch.nn transformer (fp32) on a learnable task,
    cunorm's norms against torch's from the same initial weights and batches:
    every step's loss within 1e-3 relative (rounding differs; the curves must
    not drift apart)."""
    curves = {}
    for norm in ("torch", "cunorm"):
        model = _tiny_transformer(norm, seed=6)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        gen = torch.Generator(device="cuda").manual_seed(7)
        losses = []
        for _ in range(50):  # counting sequences (each token the last plus one): learnable, so the loss falls
            start = torch.randint(0, 512, (16, 1), device="cuda", generator=gen)
            tokens = (start + torch.arange(64, device="cuda")) % 512
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, 512), tokens[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves[norm] = np.array(losses)
    assert curves["cunorm"][-1] < 0.5 * curves["cunorm"][0]  # it learns
    np.testing.assert_allclose(curves["cunorm"], curves["torch"], rtol=1e-3)


@pytest.mark.filterwarnings("ignore:Input #:UserWarning")
def test_dropout_and_rowscale_through_autograd():
    """The functional forms with dropout and a row scale (CPU: the float64
    reference): values against torch computing the same (the mask from
    cunorm.reference.dropout_keep), gradcheck at default tolerances through
    x, the residual, the weight and the bias, the same seed drawn again
    after torch.manual_seed."""
    from cunorm import reference

    torch.manual_seed(5)
    x, r = (torch.randn(4, 24, dtype=torch.float64, requires_grad=True) for _ in range(2))
    w, b = (torch.randn(24, dtype=torch.float64, requires_grad=True) for _ in range(2))
    rs = torch.rand(4, dtype=torch.float64) + 0.5
    keep = torch.from_numpy(reference.dropout_keep((4, 24), 0.3, 11))
    for fn, native in ((ct.layer_norm, lambda h: nn.functional.layer_norm(h, (24,), w, b)),
                       (lambda *a, **k: ct.rms_norm(*a, eps=1e-5, **k),
                        lambda h: h * torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-5) * w + b)):
        kw = dict(weight=w, bias=b, dropout_p=0.3, seed=11, rowscale=rs)
        y, h = fn(x, residual=r, **kw)
        h_ref = torch.where(keep, x * rs[:, None] / 0.7, 0) + r
        assert torch.allclose(h, h_ref, rtol=1e-12, atol=1e-12)
        assert torch.allclose(y, native(h_ref), rtol=1e-10, atol=1e-10)
        assert torch.autograd.gradcheck(lambda a, q, g, c: fn(a, residual=q, **dict(kw, weight=g, bias=c)),
                                        (x, r, w, b))
        assert torch.autograd.gradcheck(lambda a, g: fn(a, **dict(kw, weight=g)), (x, w))  # no residual
    torch.manual_seed(9)
    first = ct.layer_norm(x, dropout_p=0.5)
    torch.manual_seed(9)
    assert torch.equal(first, ct.layer_norm(x, dropout_p=0.5))
    with pytest.raises(ValueError, match=r"seed: an int in \[0, 2\*\*63\)"):
        ct.layer_norm(x, dropout_p=0.5, seed=2**63)


def test_parallel_block_through_autograd():
    """x1 (its own mask, stream 1) and a second weight and bias through the functional forms (CPU: the
    float64 reference): values against torch computing the same, gradcheck at default tolerances through
    x, x1, the residual and both weights and biases, with and without dropout."""
    from cunorm import reference

    torch.manual_seed(3)
    x, x1, r = (torch.randn(4, 24, dtype=torch.float64, requires_grad=True) for _ in range(3))
    w, b, w1, b1 = (torch.randn(24, dtype=torch.float64, requires_grad=True) for _ in range(4))
    for p in (0.0, 0.3):
        keep = torch.from_numpy(reference.dropout_keep((4, 24), p, 11)) if p else None
        keep1 = torch.from_numpy(reference.dropout_keep((4, 24), p, 11, stream=1)) if p else None
        for fn, rms in ((ct.layer_norm, False), (lambda *a, **k: ct.rms_norm(*a, eps=1e-5, **k), True)):
            kw = dict(weight=w, bias=b, weight1=w1, bias1=b1, dropout_p=p, seed=11)
            y, y1, h = fn(x, residual=r, x1=x1, **kw)
            drop = (lambda a, k: a if k is None else torch.where(k, a / (1 - p), 0))
            h_ref = drop(x, keep) + drop(x1, keep1) + r
            xhat = (h_ref * torch.rsqrt((h_ref * h_ref).mean(-1, keepdim=True) + 1e-5) if rms else
                    nn.functional.layer_norm(h_ref, (24,), eps=1e-5))
            assert torch.allclose(h, h_ref, rtol=1e-12, atol=1e-12)
            assert torch.allclose(y, xhat * w + b, rtol=1e-10, atol=1e-10)
            assert torch.allclose(y1, xhat * w1 + b1, rtol=1e-10, atol=1e-10)
            assert torch.autograd.gradcheck(
                lambda a, a1, q, g, c, g1, c1: fn(a, residual=q, x1=a1, **dict(kw, weight=g, bias=c, weight1=g1,
                                                                              bias1=c1)),
                (x, x1, r, w, b, w1, b1))
            assert torch.autograd.gradcheck(lambda a, a1: fn(a, x1=a1, **dict(kw, weight1=None, bias1=None)), (x, x1))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("p", [0.0, 0.2])
def test_parallel_block_on_cuda_matches_the_cpu_reference(dtype, p):
    """The parallel block's values and gradients on CUDA (cunorm's kernels through the custom ops and
    autograd) against the same calls on CPU float64 tensors (the float64 reference, the same masks)."""
    torch.manual_seed(4)
    n = 1024
    cpu = {k: torch.randn(*((64, n) if k in ("x", "x1", "r") else (n,)), dtype=torch.float64)
           + (1 if k[0] == "w" else 0) for k in ("x", "x1", "r", "w", "b", "w1", "b1")}
    results = {}
    for device in ("cpu", "cuda"):
        t = {k: v.to(device, dtype if device == "cuda" else torch.float64, copy=True).requires_grad_()
             for k, v in cpu.items()}
        y, y1, h = ct.layer_norm(t["x"], weight=t["w"], bias=t["b"], residual=t["r"], x1=t["x1"], weight1=t["w1"],
                                 bias1=t["b1"], dropout_p=p, seed=123)
        g = torch.Generator().manual_seed(5)
        dy, dy1, dh = (torch.randn(64, n, generator=g, dtype=torch.float64) for _ in range(3))
        ((y.double() * dy.to(device)).sum() + (y1.double() * dy1.to(device)).sum()
         + (h.double() * dh.to(device)).sum()).backward()
        results[device] = [y, y1, h] + [t[k].grad for k in ("x", "x1", "r", "w", "b", "w1", "b1")]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    for got, want in zip(results["cuda"], results["cpu"]):
        err = float((got.detach().double().cpu() - want.detach()).norm() / want.detach().norm())
        assert err < tol, err
