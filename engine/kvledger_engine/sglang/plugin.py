"""The SGLang general plugin (entry point ``sglang.srt.plugins``: ``kvledger``).

SGLang calls ``register()`` early in each of its processes (``load_plugins``; the scheduler
process calls it before it builds its ``Scheduler``). Without ``KVLEDGER_SGLANG_LEDGER`` it
returns at once and nothing else of kvledger is imported. With it, it registers hooks
with SGLang's ``HookRegistry`` (applied by SGLang right after the plugins ran):

- after ``Scheduler.__init__``: the scheduler's ledger (``SchedulerView`` over it, the
  document server started) on the first tensor- and pipeline-parallel rank;
- after ``Scheduler.process_batch_result`` (a step ended) and ``Scheduler.get_next_batch_to_run``
  (the scheduler looked for work; idle when it found none): ``after_step``;
- after ``Scheduler.pause_generation``: a publication of the state the scheduler pauses in;
- around ``ScheduleBatch.retract_decode``: the requests it retracted and the computed tokens
  their retraction threw away (read before SGLang frees them).

Nothing here may break SGLang: every failure (bad setting, untested release, renamed
internals, a socket that cannot be bound) is one log line and SGLang runs unchanged.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

logger = logging.getLogger("sglang.kvledger")

SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
SCHEDULE_BATCH = "sglang.srt.managers.schedule_batch.ScheduleBatch"
#: the ledger's attribute on the scheduler
ATTRIBUTE = "_kvledger"


def register() -> None:
    """The entry point. Inert unless KVLEDGER_SGLANG_LEDGER is set; never raises."""
    try:
        from kvledger_engine.sglang.settings import Settings

        settings = Settings.from_env()
        if settings is None:
            return
        from kvledger_engine.sglang import internals

        version = internals.sglang_version()
        internals.check_version(version, settings.allow_untested)
        hooks = importlib.import_module("sglang.srt.plugins.hook_registry")
        HookRegistry, HookType = hooks.HookRegistry, hooks.HookType
        HookRegistry.register(f"{SCHEDULER}.__init__", _attacher(settings, version), HookType.AFTER)
        HookRegistry.register(f"{SCHEDULER}.process_batch_result", _after_step, HookType.AFTER)
        HookRegistry.register(f"{SCHEDULER}.get_next_batch_to_run", _after_looking, HookType.AFTER)
        HookRegistry.register(f"{SCHEDULER}.pause_generation", _after_pause, HookType.AFTER)
        HookRegistry.register(f"{SCHEDULE_BATCH}.retract_decode", _around_retract, HookType.AROUND)
    except Exception as exc:
        logger.warning("kvledger: the SGLang ledger plugin is off: %s", exc)


#: ``Scheduler.__init__``'s parameters after ``self``, in SGLang 0.5.23's order
INIT_PARAMETERS = ("server_args", "port_args", "gpu_id", "tp_rank", "moe_ep_rank", "pp_rank", "attn_cp_rank",
                   "moe_dp_rank", "dp_rank")


def _attacher(settings: Any, version: str) -> Any:
    def after_init(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
        given = {**dict(zip(INIT_PARAMETERS, args, strict=False)), **kwargs}
        attach(scheduler, settings, version, {k: v for k, v in given.items() if k in ("tp_rank", "pp_rank", "dp_rank")})

    return after_init


#: this process's ledger (SGLang runs one scheduler per process); the retraction hook,
#: a method of the batch, finds it here
_LEDGER: list[Any] = []


def attach(scheduler: Any, settings: Any, version: str, ranks: dict[str, Any] | None = None) -> None:
    """Give ``scheduler`` its ledger (or none, with the one log line saying why)."""
    setattr(scheduler, ATTRIBUTE, None)
    try:
        from kvledger_engine.sglang.internals import SchedulerView
        from kvledger_engine.sglang.ledger import SchedulerLedger

        view = SchedulerView(scheduler, settings.tenant_mode, ranks)
        if not view.serving_rank:
            return  # another tensor/pipeline rank of this data-parallel rank serves the same pages
        ledger = SchedulerLedger(view, settings, version)
    except Exception as exc:
        logger.warning("kvledger: the SGLang ledger is off for this scheduler: %s", exc)
        return
    setattr(scheduler, ATTRIBUTE, ledger)
    _LEDGER[:] = [ledger]
    logger.info("kvledger: serving the KV ledger of data-parallel rank %d at %s (%d pages of %d tokens, %d bytes each)",
                view.dp_rank, ledger.url, view.num_pages, view.page_size, view.static.block_bytes)


def _after_step(result: Any, scheduler: Any, batch: Any = None, *args: Any, **kwargs: Any) -> None:
    ledger = getattr(scheduler, ATTRIBUTE, None)
    if ledger is not None:
        batch = batch if batch is not None else kwargs.get("batch")
        ledger.after_step(() if batch is None else (batch,))


def _after_looking(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    ledger = getattr(scheduler, ATTRIBUTE, None)
    if ledger is not None:
        # 0.5.23 returns a plan: the batch to run and the running batch, which the scheduler
        # takes as its own only after this hook; builds before it return the batch
        batch = getattr(result, "batch_to_run", result)
        running = getattr(result, "running_batch", None)
        ledger.after_step(tuple(b for b in (batch, running) if b is not None), idle=batch is None)


def _after_pause(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    ledger = getattr(scheduler, ATTRIBUTE, None)
    if ledger is not None:
        ledger.publish_now("after a pause")


def _around_retract(original: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    ledger = _LEDGER[0] if _LEDGER else None
    if ledger is None or not ledger.on:
        return original(batch, *args, **kwargs)
    try:
        from kvledger_engine.sglang.internals import SchedulerView

        before = {id(r): SchedulerView.retraction(r) for r in batch.reqs}
    except Exception as exc:
        ledger.fail("before a retraction", exc)
        return original(batch, *args, **kwargs)
    result = original(batch, *args, **kwargs)
    try:
        retracted = list(result[0] if isinstance(result, tuple) else result)
        ledger.on_retract(retracted, sum(before.get(id(r), 0) for r in retracted))
    except Exception as exc:
        ledger.fail("after a retraction", exc)
    return result
