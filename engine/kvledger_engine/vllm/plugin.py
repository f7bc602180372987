"""The vLLM general plugin (entry point ``vllm.general_plugins``: ``kvledger``).

vLLM calls ``register()`` in every process it starts (the API server, each EngineCore).
Without ``KVLEDGER_VLLM_LEDGER`` it returns at once and nothing else of kvledger is
imported. With it, it wraps ``SchedulerConfig.get_scheduler_cls`` so that the scheduler
vLLM (or the user's ``--scheduler-cls``) chose is built as a subclass that mixes in
``LedgerHooks``; only a process that builds a scheduler (EngineCore) serves a ledger.

Nothing here may break vLLM: every failure (bad setting, untested release, renamed
internals, a socket that cannot be bound) is one log line and vLLM runs unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger("vllm.kvledger")


def register() -> None:
    """The entry point. Inert unless KVLEDGER_VLLM_LEDGER is set; never raises."""
    try:
        from kvledger_engine.vllm.settings import Settings

        settings = Settings.from_env()
        if settings is None:
            return
        from kvledger_engine.vllm import internals

        internals.check_version(internals.vllm_version(), settings.allow_untested)
        internals.patch_scheduler_choice(_attacher(settings), LedgerHooks)
    except Exception as exc:
        logger.warning("kvledger: the vLLM ledger integration is off: %s", exc)


def _attacher(settings: Any) -> Any:
    # one function object per settings value: internals caches the subclass by it
    return _ATTACHERS.setdefault(settings, lambda scheduler: attach(scheduler, settings))


_ATTACHERS: dict[Any, Any] = {}


def attach(scheduler: Any, settings: Any) -> None:
    """Give ``scheduler`` its ledger (or none, with the one log line saying why)."""
    scheduler._kvledger = None
    try:
        from kvledger_engine.vllm import internals
        from kvledger_engine.vllm.engine_core import EngineLedger

        view = internals.EngineView(scheduler, settings.tenant_mode)
        ledger = EngineLedger(view, settings, internals.vllm_version())
    except Exception as exc:
        logger.warning("kvledger: the vLLM ledger integration is off for this engine core: %s", exc)
        return
    scheduler._kvledger = ledger
    logger.info(
        "kvledger: serving the KV ledger of data-parallel rank %d at %s (%d blocks of %d tokens, %d bytes each; %s)",
        view.dp_rank, ledger.url, view.static.num_blocks, view.static.block_size, view.static.block_bytes,
        _chosen_class(scheduler),
    )


def _chosen_class(scheduler: Any) -> str:
    """The scheduler class vLLM (or ``--scheduler-cls``) chose, under the ledger's subclass."""
    mro = type(scheduler).__mro__
    return mro[mro.index(LedgerHooks) + 1].__name__ if LedgerHooks in mro[:-1] else type(scheduler).__name__


class LedgerHooks:
    """Mixed in before the chosen scheduler class: each hook calls the scheduler first."""

    _kvledger: Any = None

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        ledger = self._kvledger
        before = ledger.before_schedule() if ledger is not None else None
        output = super().schedule(*args, **kwargs)  # type: ignore[misc]  # the scheduler class this mixin is put before
        if ledger is not None:
            ledger.after_schedule(output, before)
        return output

    def add_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        result = super().add_request(request, *args, **kwargs)  # type: ignore[misc]  # the scheduler class this mixin is put before
        ledger = self._kvledger
        if ledger is not None:
            ledger.after_add(getattr(request, "request_id", None))
        return result

    def finish_requests(self, request_ids: str | Iterable[str] | None, *args: Any, **kwargs: Any) -> Any:
        ledger = self._kvledger
        if ledger is not None and request_ids is not None:
            request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        result = super().finish_requests(request_ids, *args, **kwargs)  # type: ignore[misc]  # the scheduler class this mixin is put before
        if ledger is not None:
            ledger.after_finish(request_ids)
        return result

    def set_pause_state(self, *args: Any, **kwargs: Any) -> Any:
        # a paused engine stops calling schedule(): publish the state it pauses in
        result = super().set_pause_state(*args, **kwargs)  # type: ignore[misc]  # the scheduler class this mixin is put before
        ledger = self._kvledger
        if ledger is not None:
            ledger.publish_now("after a pause or resume")
        return result

    def shutdown(self, *args: Any, **kwargs: Any) -> Any:
        ledger = self._kvledger
        if ledger is not None:
            ledger.close()
        return super().shutdown(*args, **kwargs)  # type: ignore[misc]  # the scheduler class this mixin is put before
