"""The DSA kernels' precision and algorithm switches as absl flags, shared by the experiments
that build a Runtime (replay, tep_project, multigpu_run): --topk_method, --indexer_queries,
--attention_queries (glmjax.runtime.Runtime's fields of those names)."""

from typing import Callable

from absl import flags

from glmjax.runtime import QUERY_DTYPES
from pallas_kernels.topk import METHODS


def define() -> Callable[[], dict[str, str]]:
  """Defines the flags; returns a function reading them as `make_runtime` keyword arguments."""
  topk = flags.DEFINE_enum("topk_method", "radix", list(METHODS), "the Pallas top-k's algorithm (--attention=pallas)")
  indexer = flags.DEFINE_enum("indexer_queries", "float32", list(QUERY_DTYPES), "precision of the indexer's queries")
  attention = flags.DEFINE_enum("attention_queries", "float32", list(QUERY_DTYPES),
                                "precision of the decode attention's queries (bfloat16: FlashMLA's numerics)")
  return lambda: dict(topk_method=topk.value, indexer_queries=indexer.value, attention_queries=attention.value)
