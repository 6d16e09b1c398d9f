"""The names of meshlm's precisions, without torch: what ``precision.dtype``,
``precision.fp8_rest`` and ``precision.fp8_recipe`` accept (configuration checks and the
planner read them; :mod:`meshlm.precision` maps the autocast names to torch dtypes).
No communication, no memory."""

from __future__ import annotations

AUTOCAST_NAMES = ("fp32", "bf16", "fp16")  # the autocast dtypes (meshlm.precision.DTYPES)
# precision.dtype=fp8: the decoder blocks' linears in float8 (meshlm.parallel.float8), the rest
# under autocast in one of these (precision.fp8_rest)
FP8_REST = ("bf16", "fp32")
FP8_RECIPES = ("tensorwise", "rowwise")  # torchao's recipe names (precision.fp8_recipe)
PRECISIONS = (*AUTOCAST_NAMES, "fp8")  # precision.dtype: the autocast dtypes, and fp8
