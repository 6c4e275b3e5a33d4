"""The mini model's corpus: the Python standard library's source files, byte-tokenized.

Every `*.py` file under the stdlib root (site-packages excluded) is one document, bos + bytes +
eos. Files are assigned to train or validation by a SHA-256 of their path relative to the root,
so the split never cuts a file and is the same on every machine with the same file set (Python's
own `hash` is salted per process). Documents are concatenated, in sorted path order, into one
uint16 stream per split. Training batches are random windows of the train stream, drawn from a
generator seeded by (seed, step): a resumed run sees exactly the batches it would have seen.
"""

import dataclasses
import hashlib
import pathlib
import sysconfig

import numpy as np

from glmjax.tokenizer import ByteTokenizer

EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})


def stdlib_root() -> pathlib.Path:
  return pathlib.Path(sysconfig.get_paths()["stdlib"])


def source_files(root: str | pathlib.Path) -> list[str]:
  """Sorted POSIX paths, relative to `root`, of the `*.py` files outside EXCLUDED_DIRS."""
  root = pathlib.Path(root)
  files = [p.relative_to(root) for p in root.rglob("*.py") if p.is_file()]
  return sorted(p.as_posix() for p in files if not EXCLUDED_DIRS.intersection(p.parts[:-1]))


def is_validation(relpath: str, fraction: float) -> bool:
  """Whether the file goes to validation: the path's SHA-256, read as a number in [0, 1), < fraction."""
  if not 0.0 <= fraction < 1.0:
    raise ValueError(f"validation fraction must be in [0, 1), got {fraction}")
  digest = hashlib.sha256(relpath.encode("utf-8")).digest()
  return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < fraction


def sample_windows(stream: np.ndarray, rng: np.random.Generator, batch_size: int, seq_len: int) -> np.ndarray:
  """batch_size random windows of seq_len + 1 consecutive tokens (inputs and next-token targets)
  -> int32 [batch_size, seq_len + 1]."""
  if len(stream) < seq_len + 1:
    raise ValueError(f"stream of {len(stream)} tokens is shorter than one window ({seq_len + 1})")
  starts = rng.integers(0, len(stream) - seq_len, batch_size)
  return stream[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
  """Token streams of the two splits. val_doc_starts: offset of each validation document."""
  root: str
  train_files: tuple[str, ...]
  val_files: tuple[str, ...]
  train: np.ndarray          # uint16 [train tokens]
  val: np.ndarray            # uint16 [validation tokens]
  val_doc_starts: np.ndarray  # int64 [len(val_files)]

  def train_batch(self, step: int, *, batch_size: int, seq_len: int, seed: int) -> np.ndarray:
    """The training windows of `step`: int32 [batch_size, seq_len + 1], a function of (seed, step)."""
    return sample_windows(self.train, np.random.default_rng([seed, step]), batch_size, seq_len)

  def validation_windows(self, seq_len: int, max_windows: int | None = None) -> np.ndarray:
    """Non-overlapping windows int32 [n, seq_len + 1] of the validation stream, evenly spaced over
    it when there is room for more than max_windows. Deterministic: every evaluation uses the same."""
    available = len(self.val) // (seq_len + 1)
    if available == 0:
      raise ValueError(f"validation stream of {len(self.val)} tokens is shorter than one window ({seq_len + 1})")
    n = available if max_windows is None else min(max_windows, available)
    slots = np.linspace(0, available - 1, n).round().astype(np.int64)
    return self.val[slots[:, None] * (seq_len + 1) + np.arange(seq_len + 1)].astype(np.int32)

  def sample_validation_text(self, rng: np.random.Generator, n_tokens: int) -> list[int]:
    """n_tokens consecutive held-out tokens starting at a random validation document's bos (the
    text runs on into the following documents): real text for workloads, unseen in training."""
    fits = self.val_doc_starts[self.val_doc_starts + n_tokens <= len(self.val)]
    if n_tokens <= 0 or len(fits) == 0:
      raise ValueError(f"n_tokens must be in [1, {len(self.val)}] (the validation stream), got {n_tokens}")
    start = int(rng.choice(fits))
    return self.val[start:start + n_tokens].astype(np.int64).tolist()

  def describe(self) -> dict:
    """Sizes and a content digest of both splits (the digest tells two corpora apart)."""
    digest = hashlib.sha256(self.train.tobytes() + self.val.tobytes()).hexdigest()[:16]
    return {"root": self.root, "train_files": len(self.train_files), "val_files": len(self.val_files),
            "train_tokens": len(self.train), "val_tokens": len(self.val), "digest": digest}


def load_corpus(root: str | pathlib.Path | None = None, *, val_fraction: float = 0.02,
                tokenizer: ByteTokenizer = ByteTokenizer()) -> Corpus:
  """Read and tokenize every source file under `root` (default: this Python's stdlib)."""
  root = pathlib.Path(root) if root is not None else stdlib_root()
  files = source_files(root)
  split = {"train": [], "val": []}
  for rel in files:
    split["val" if is_validation(rel, val_fraction) else "train"].append(rel)
  if not split["train"] or not split["val"]:
    raise ValueError(f"{root}: {len(files)} source files give {len(split['train'])} train and "
                     f"{len(split['val'])} validation files (val_fraction={val_fraction}); both must be non-empty")
  streams = {}
  for name, rels in split.items():
    docs = [tokenizer.encode_document((root / rel).read_bytes()) for rel in rels]
    streams[name] = (np.concatenate(docs), np.cumsum([0] + [len(d) for d in docs[:-1]]))
  return Corpus(str(root), tuple(split["train"]), tuple(split["val"]), streams["train"][0], streams["val"][0],
                streams["val"][1])
