"""Train a small torch.nn transformer twice, from the same initial weights and
batches: once with torch's norms, once with cunorm's (`replace_norms`), and
print the two loss curves side by side. Needs torch (pip install
"cunorm[torch]"); runs on a CUDA GPU, or slowly on the CPU (cunorm's ops then
run the float64 reference).

    python examples/train_torch.py [--steps 50] [--dtype bfloat16]
"""
import argparse
import time

import torch
from torch import nn

import cunorm.torch as ct


def model(vocab: int, width: int, layers: int, device, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True,
                                       device=device)
    return nn.Sequential(nn.Embedding(vocab, width, device=device),
                         nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
                         nn.LayerNorm(width, device=device), nn.Linear(width, vocab, device=device))


def train(net: nn.Module, steps: int, vocab: int, batch: int, seq: int, dtype, device) -> list:
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    gen = torch.Generator(device=device).manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, seq + 1), device=device, generator=gen)
        with torch.autocast(device_type=device.type, dtype=dtype, enabled=dtype != torch.float32):
            logits = net(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--width", type=int, default=256)
    a = p.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, a.dtype)
    vocab, batch, seq = 512, (16 if device.type == "cuda" else 4), (64 if device.type == "cuda" else 16)
    curves = {}
    for norms in ("torch", "cunorm"):
        net = model(vocab, a.width, 2, device, seed=0)
        if norms == "cunorm":
            swapped = ct.replace_norms(net)
            print(f"cunorm: replaced {len(swapped)} norms ({', '.join(name for name, _ in swapped)})")
        t = time.perf_counter()
        curves[norms] = train(net, a.steps, vocab, batch, seq, dtype, device)
        print(f"{norms:>6}: {a.steps} steps in {time.perf_counter() - t:.1f} s")
    print(f"{'step':>5} {'torch':>9} {'cunorm':>9} {'rel diff':>9}")
    for i, (t, c) in enumerate(zip(curves["torch"], curves["cunorm"])):
        if i % max(1, a.steps // 10) == 0 or i == a.steps - 1:
            print(f"{i:>5} {t:>9.4f} {c:>9.4f} {abs(c - t) / t:>9.2e}")
    worst = max(abs(c - t) / t for t, c in zip(curves["torch"], curves["cunorm"]))
    print(f"largest relative difference over {a.steps} steps: {worst:.2e}")


if __name__ == "__main__":
    main()
