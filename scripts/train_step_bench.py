"""One training step of a 4-layer pre-norm transformer (RMSNorm, hidden 2048,
sequence 2048, batch 8, bf16) with torch's norms, with cunorm's, and with no
norms at all (to bound the norms' share), same run: median step time over
`--steps` timed steps (CUDA events), after warm-up.

    python scripts/train_step_bench.py [--steps 20]
"""
import argparse
import statistics

import torch
from torch import nn
from torch.nn import functional as F

import cunorm.torch as ct


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.RMSNorm(width, eps=1e-6), nn.RMSNorm(width, eps=1e-6)
        self.qkv, self.proj = nn.Linear(width, 3 * width, bias=False), nn.Linear(width, width, bias=False)
        self.up, self.down = nn.Linear(width, 4 * width, bias=False), nn.Linear(4 * width, width, bias=False)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def build(norms: str, width=2048, layers=4, heads=16):
    torch.manual_seed(0)
    net = nn.Sequential(*[Block(width, heads) for _ in range(layers)], nn.RMSNorm(width, eps=1e-6))
    net = net.to("cuda", torch.bfloat16)
    if norms == "cunorm":
        ct.replace_norms(net)
    elif norms == "none":
        for name, m in list(net.named_modules()):
            for child_name, child in list(m.named_children()):
                if isinstance(child, nn.RMSNorm):
                    setattr(m, child_name, nn.Identity())
    return net


def step_ms(net, x, steps: int) -> list:
    opt = torch.optim.SGD(net.parameters(), lr=1e-4)

    def step():
        opt.zero_grad(set_to_none=True)
        net(x).float().square().mean().backward()
        opt.step()

    for _ in range(3):
        step()
    times = []
    for _ in range(steps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    x = torch.randn(8, 2048, 2048, device="cuda", dtype=torch.bfloat16)
    nets = {k: build(k) for k in ("torch", "cunorm", "none")}
    results = {k: [] for k in nets}
    for _ in range(a.rounds):  # interleaved rounds
        for k, net in nets.items():
            results[k] += step_ms(net, x, a.steps)
    print(f"# {torch.cuda.get_device_name()}: training step, 4 layers, hidden 2048, seq 2048, batch 8, bf16")
    med = {k: statistics.median(v) for k, v in results.items()}
    for k, v in results.items():
        print(f"{k:>7}: median {med[k]:8.2f} ms  [min {min(v):.2f}, max {max(v):.2f}] over {len(v)} steps")
    share = (med["torch"] - med["none"]) / med["torch"]
    print(f"cunorm / torch step time: {med['cunorm'] / med['torch']:.4f}; norms' share of torch's step "
          f"(torch - none) / torch: {share:.3f}; of cunorm's: {(med['cunorm'] - med['none']) / med['cunorm']:.3f}")


if __name__ == "__main__":
    main()
