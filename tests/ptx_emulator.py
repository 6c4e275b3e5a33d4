"""An emulator of exactly the PTX instructions the kernels' inline programs use, on uint32
register arrays, to check those programs on the CPU: the Pallas interpreter cannot run inline
PTX. Registers are numpy arrays over instances (one per thread's call); `mma.sync` reads the
instances as a warp's lanes, 32 in a row."""

import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from pallas_kernels.nvfp4_fragments import mma_m16n8k16


def f16_value(bits: np.ndarray) -> np.ndarray:
  return bits.astype(np.uint16).view(np.float16).astype(np.float64)


def f16_bits(values: np.ndarray) -> np.ndarray:
  return values.astype(np.float16).view(np.uint16).astype(np.uint32)


def bf16_value(bits: np.ndarray) -> np.ndarray:
  return bits.astype(np.uint16).view(ml_dtypes.bfloat16).astype(np.float64)


def bf16_bits(values: np.ndarray) -> np.ndarray:
  return values.astype(ml_dtypes.bfloat16).view(np.uint16).astype(np.uint32)


def f32_value(bits: np.ndarray) -> np.ndarray:
  return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def f32_bits(values: np.ndarray) -> np.ndarray:
  return values.astype(np.float32).view(np.uint32)


def _halves(op, *regs: np.ndarray, value=f16_value, bits=f16_bits) -> np.ndarray:
  """An fp16x2 (or, with bf16's value and bits, bf16x2) instruction: op on both halves in
  float64, each rounded once (subnormals kept)."""
  lo = op(*(value(r & 0xFFFF) for r in regs))
  hi = op(*(value(r >> 16) for r in regs))
  return bits(lo) | (bits(hi) << 16)


def _e4m3x2_to_f16x2(a: np.ndarray) -> np.ndarray:
  """cvt.rn.f16x2.e4m3x2: the low byte of a 16-bit register to the low half (exact)."""
  byte = lambda i: ((a >> (8 * i)) & 0xFF).astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
  return f16_bits(byte(0)) | (f16_bits(byte(1)) << 16)


OPS = {
    "shl.b32": lambda a, b: a << b,
    "shr.b32": lambda a, b: a >> b,
    "shf.l.wrap.b32": lambda a, b, n: (b << (n & 31)) | (a >> (32 - (n & 31))),  # {b, a} << n, its high word
    "shf.r.wrap.b32": lambda a, b, n: (a >> (n & 31)) | (b << (32 - (n & 31))),  # {b, a} >> n, its low word
    "and.b32": lambda a, b: a & b,
    "or.b32": lambda a, b: a | b,
    "mul.rn.f16x2": lambda a, b: _halves(lambda x, y: x * y, a, b),
    "fma.rn.f16x2": lambda a, b, c: _halves(lambda x, y, z: x * y + z, a, b, c),
    "fma.rn.bf16x2": lambda a, b, c: _halves(lambda x, y, z: x * y + z, a, b, c, value=bf16_value, bits=bf16_bits),
    "cvt.f32.f16": lambda a: f32_bits(f16_value(a)),
    "cvt.rn.f16x2.e4m3x2": _e4m3x2_to_f16x2,
    "add.f32": lambda a, b: f32_bits(f32_value(a) + f32_value(b)),
    "fma.rn.f32": lambda a, b, c: f32_bits(f32_value(a) * f32_value(b) + f32_value(c)),
    "mov.f32": lambda a: a,
}


def _mma(a: list, b: list, c: list, operands: str) -> list:
  """mma.sync m16n8k16 f32.f16.f16.f32 (or .bf16.bf16) over a warp's 32 lanes
  (pallas_kernels.nvfp4_fragments' jnp form of the PTX ISA's fragment layouts, checked there
  against plain matrices)."""
  lanes = lambda r: jnp.asarray(r.reshape(-1, 32))
  d = mma_m16n8k16([lanes(r) for r in a], [lanes(r) for r in b],
                   [lanes(f32_value(r).astype(np.float32)) for r in c], operands)
  return [f32_bits(np.asarray(r).reshape(-1)) for r in d]


def run_ptx(asm: str, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """Evaluates a PTX program on uint32 register arrays (`inputs`: "$i" -> values) and returns
  every register."""
  regs = {name: np.asarray(v, np.uint64).astype(np.uint32) for name, v in inputs.items()}
  value = lambda tok: regs[tok] if tok in regs else np.uint32(int(tok, 0))
  for line in asm.replace("\n", " ").split(";"):
    line = line.strip().removeprefix("{").strip()
    if not line or line.startswith((".reg", "}")):
      continue
    op, args = line.split(None, 1)
    if op.startswith("mma.sync"):  # {d0..d3}, {a0..a3}, {b0, b1}, {c0..c3}
      d, a, b, c = ([t.strip() for t in group.split(",")] for group in re.findall(r"\{([^}]*)\}", args))
      operands = "bfloat16" if ".bf16." in op else "float16"
      for name, out in zip(d, _mma([value(t) for t in a], [value(t) for t in b], [value(t) for t in c], operands)):
        regs[name] = out
      continue
    if op == "mov.b32" and args.lstrip().startswith("{"):  # mov.b32 {lo, hi}, h: unpack the halves
      halves, src = args.rsplit(",", 1)
      lo, hi = (t.strip() for t in halves.strip(" {}").split(","))
      regs[lo], regs[hi] = value(src.strip()) & 0xFFFF, value(src.strip()) >> 16
      continue
    if op == "mov.b32" and "{" not in args:  # mov.b32 d, a
      dst, src = (t.strip() for t in args.split(","))
      regs[dst] = np.broadcast_to(value(src), next(iter(regs.values())).shape).astype(np.uint32)
      continue
    if op == "mov.b32":  # mov.b32 d, {lo, hi}: pack two halves
      dst, halves = args.split(",", 1)
      lo, hi = (value(t.strip()) for t in halves.strip(" {}").split(","))
      regs[dst.strip()] = (lo & 0xFFFF) | ((hi & 0xFFFF) << 16)
      continue
    dst, *src = [a.strip() for a in args.split(",")]
    a = [value(x) for x in src]
    if op == "prmt.b32":   # bytes of {b, a}: a is bytes 0-3, b 4-7; selector nibble i picks byte i
      pool = [(np.uint32(x) >> np.uint32(8 * i)) & np.uint32(0xFF) for x in a[:2] for i in range(4)]
      sel = int(a[2])
      out = sum(pool[(sel >> (4 * i)) & 7].astype(np.uint64) << np.uint64(8 * i) for i in range(4))
    else:
      out = OPS[op](*a)
    regs[dst] = np.asarray(out).astype(np.uint64).astype(np.uint32)
  return regs
