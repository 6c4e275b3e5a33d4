"""Byte-level tokenizer of the mini model: ids 0-255 are bytes, then the special tokens.

The layout is that of `configs/mini.py`: bos 256, eos 257, pad 258 and one reserved id (259),
260 in all. Text is UTF-8; decoding replaces invalid byte sequences (a sampled model may emit
them) and drops special tokens. `to_json()` is the self-describing `tokenizer.json` written
beside a checkpoint.
"""

import dataclasses
import json

import numpy as np

from glmjax.config import ModelConfig

NUM_BYTES = 256
TOKENIZER_TYPE = "byte-level"


@dataclasses.dataclass(frozen=True)
class ByteTokenizer:
  bos_id: int = 256
  eos_id: int = 257
  pad_id: int = 258
  vocab_size: int = 260

  def __post_init__(self):
    specials = self.special_tokens
    for name, token in specials.items():
      if not NUM_BYTES <= token < self.vocab_size:
        raise ValueError(f"{name}_id {token} must be in [{NUM_BYTES}, vocab_size={self.vocab_size}): "
                         "ids below 256 are bytes")
    if len(set(specials.values())) != len(specials):
      raise ValueError(f"special token ids must be distinct, got {specials}")

  @property
  def special_tokens(self) -> dict[str, int]:
    return {"bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id}

  def encode(self, text: str, *, bos: bool = False, eos: bool = False) -> list[int]:
    """UTF-8 bytes of `text` as ids, optionally wrapped in bos/eos."""
    return [self.bos_id] * bos + list(text.encode("utf-8")) + [self.eos_id] * eos

  def encode_document(self, data: bytes) -> np.ndarray:
    """bos + raw bytes + eos as uint16 [len(data) + 2]: one training document."""
    return np.concatenate([[self.bos_id], np.frombuffer(data, np.uint8), [self.eos_id]]).astype(np.uint16)

  def decode(self, ids) -> str:
    """Bytes back to text (invalid UTF-8 replaced); special and reserved ids are dropped."""
    ids = [int(i) for i in ids]
    bad = [i for i in ids if not 0 <= i < self.vocab_size]
    if bad:
      raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
    return bytes(i for i in ids if i < NUM_BYTES).decode("utf-8", errors="replace")

  def configure(self, config: ModelConfig) -> ModelConfig:
    """`config` with this tokenizer's special ids (a no-op for mini); its vocabulary must hold them."""
    if config.vocab_size < self.vocab_size:
      raise ValueError(f"vocab_size {config.vocab_size} is smaller than the byte tokenizer's "
                       f"{self.vocab_size}")
    return dataclasses.replace(config, bos_token_id=self.bos_id, eos_token_id=self.eos_id,
                               pad_token_id=self.pad_id)

  def to_json(self) -> str:
    return json.dumps({"type": TOKENIZER_TYPE, "vocab_size": self.vocab_size,
                       "bytes": {"first_id": 0, "count": NUM_BYTES, "text_encoding": "utf-8"},
                       "special_tokens": self.special_tokens}, indent=2)

  @classmethod
  def from_json(cls, text: str) -> "ByteTokenizer":
    spec = json.loads(text)
    if spec.get("type") != TOKENIZER_TYPE:
      raise ValueError(f"tokenizer type must be {TOKENIZER_TYPE!r}, got {spec.get('type')!r}")
    if spec.get("bytes", {}).get("first_id") != 0 or spec["bytes"].get("count") != NUM_BYTES:
      raise ValueError(f"byte ids must be 0-{NUM_BYTES - 1}, got {spec.get('bytes')}")
    special = spec.get("special_tokens", {})
    missing = [k for k in ("bos", "eos", "pad") if k not in special]
    if missing:
      raise ValueError(f"tokenizer.json: special_tokens lacks {missing}")
    return cls(bos_id=special["bos"], eos_id=special["eos"], pad_id=special["pad"], vocab_size=spec["vocab_size"])
