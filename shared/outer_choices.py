"""The names of the outer optimizer's choices, without their JAX implementations.

The outer's settings, the job spec and the gateway validate a choice against these names;
``services/outer/`` implements each one (docs/ALGORITHMS.md explains them).
"""

from __future__ import annotations

from typing import Literal, get_args

OuterOptimizerName = Literal["sgd", "nesterov", "delayed_nesterov"]
MergePolicyName = Literal["each", "quorum"]
StalenessRuleName = Literal["constant", "polynomial", "hinge", "exponential"]
CombineName = Literal["weighted", "rda", "median", "trimmed_mean"]
TokenWeightingName = Literal["uniform", "tokens", "tokens2_per_step"]
#: What the norm guard does with an upload far above the usual norm (services/outer/norm_guard.py).
NormGuardName = Literal["reject", "clip", "off"]
#: Codecs the outer may send the global params in (a subset of ``shared.codec.config``'s).
ParamsCodecName = Literal["fp32", "bf16", "int8"]

OPTIMIZERS: tuple[str, ...] = get_args(OuterOptimizerName)
POLICIES: tuple[str, ...] = get_args(MergePolicyName)
STALENESS_RULES: tuple[str, ...] = get_args(StalenessRuleName)
COMBINES: tuple[str, ...] = get_args(CombineName)
TOKEN_WEIGHTINGS: tuple[str, ...] = get_args(TokenWeightingName)
NORM_GUARDS: tuple[str, ...] = get_args(NormGuardName)
PARAMS_CODECS: tuple[str, ...] = get_args(ParamsCodecName)
