"""References the cast tests share: tensors that reach every edge, and torch's own casts.

A test's reference here is torch's cast itself (or mplab.numerics.formats' exact rounding), never
the code under test."""

import math

import torch

from mplab.numerics import formats

LOW = ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
ALL = LOW + ["fp32"]
SCALES = [1.0, 2.0**-3, 8.0, 2.0**10, 2.0**24, 3.0, 0.1, 1000.5]
E4M3_OVERFLOW = 464.0  # 448 + half its ulp (32); the tie rounds to 448, whose mantissa is even


def spread(n: int, seed: int = 0, lo: float = -45, hi: float = 20) -> torch.Tensor:
    """Random signs and log-uniform magnitudes 2^lo..2^hi, 2 % exact zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.exp2(torch.rand(n, generator=g) * (hi - lo) + lo)
    x = torch.where(torch.rand(n, generator=g) < 0.5, -x, x)
    x[: n // 50] = 0.0
    return x


def edge_values(precision: str) -> torch.Tensor:
    """The rounding edges of a format in fp32 and their fp32 neighbours on both sides."""
    f = formats.get_format(precision)
    edges = [float(f.min_subnormal) / 2, float(f.min_normal) - float(f.min_subnormal) / 2,
             float(f.max_finite), float(f.min_subnormal), float(f.min_normal)]
    top_ulp = 2.0 ** (f.emax - f.man_bits)
    edges.append(float(f.max_finite) + top_ulp / 2)
    t = torch.tensor([e for e in edges if 0 < e < 3e38], dtype=torch.float32)
    t = t[t > 0]
    up = torch.nextafter(t, torch.tensor(math.inf))
    down = torch.nextafter(t, torch.tensor(0.0))
    both = torch.cat([t, up, down])
    return torch.cat([both, -both])


def direct(x: torch.Tensor, precision: str, scale: float) -> dict:
    """Classify each value by casting it with torch (the definition the library must meet)."""
    f = formats.get_format(precision)
    x = x.float()
    v = x * scale
    q = v.to(f.dtype()).float()
    nz = x.isfinite() & (x != 0)
    under = nz & (q == 0)
    over = nz & ((v.abs() > E4M3_OVERFLOW) if f.name == "fp8_e4m3" else q.isinf())
    kept = nz & ~under & ~over
    sub = kept & (q.abs() < float(f.min_normal))
    return {"count": x.numel(), "zero": int((x == 0).sum()), "underflow": int(under.sum()),
            "subnormal": int(sub.sum()), "normal": int((kept & ~sub).sum()),
            "overflow": int(over.sum()), "inf": int(x.isinf().sum()),
            "nan": int(x.isnan().sum())}



def grads_like() -> torch.Tensor:
    """Gradient-like magnitudes 2^-34..2^-2, a few large outliers, 30 % exact zeros."""
    x = spread(50_000, seed=5, lo=-34, hi=-2)
    x[:15_000] = 0.0
    x[-3:] = torch.tensor([0.5, -2.0, 30.0])
    return x
