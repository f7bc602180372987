"""`kvledger plan`: does a deployment's device budget close at its maximum shapes?

Two inputs, one report:

- ``plan_from_model`` (``from_model``): a model's ``config.json``, a device (a GPU of
  ``GPUS`` or a memory size), tensor parallelism, KV dtype, block size, the scheduler's
  limits and the memory terms the config cannot give (workspace peak, runtime buffers,
  reserve), each marked ``measured``, ``configured`` or ``estimate``;
- ``plan_from_live`` (``from_live``): a running kvledger's JSON view or /metrics, whose
  measured terms and configuration replace the derivations.

The whole planner is in this package: ``layers`` (a config's layer types and their pools)
and ``weights`` (the weights counted from a config's shapes), ``sizing`` (vLLM's block
arithmetic: pages, layer groups, pool blocks, concurrency; R(r) is the policy's own,
``policy.reservations``), ``report`` (the terms, the report and the budget verdict) and
``table`` (the report for people; ``Report.to_json`` for tools). Bytes per block of a
config (``model.block_bytes.kv_shape``) and reading a ``config.json``
(``collect.sources.model_config``) are the daemon's, shared with it.
"""

from __future__ import annotations

from kvledger.tools.plan.from_live import fetch_live, parse_live, plan_from_live
from kvledger.tools.plan.from_model import GPUS, ModelPlanInput, plan_from_model
from kvledger.tools.plan.report import PlanError, Report, parse_lengths, parse_term
from kvledger.tools.plan.table import render_table

__all__ = [
    "GPUS",
    "ModelPlanInput",
    "PlanError",
    "Report",
    "fetch_live",
    "parse_lengths",
    "parse_live",
    "parse_term",
    "plan_from_live",
    "plan_from_model",
    "render_table",
]
