"""Registers forge's names with torch's logging: ``TORCH_LOGS="forge"`` and ``"+forge"``.

torch validates ``TORCH_LOGS`` while it is being imported, after loading the plugins of
the ``torch.backends`` entry point group and before anything else could register a name;
this module is that plugin. It lives outside the ``forge_compile`` package because
importing the package needs the whole of torch, which is not ready at that point.

* ``TORCH_LOGS="forge"``: one line per fusion decision (the ``forge_compile`` loggers at INFO);
* ``TORCH_LOGS="+forge"``: also the post-grad graphs before and after the rewrite (DEBUG;
  graphs are then compiled without Inductor's caches, which would skip the rewrite);
* ``TORCH_LOGS="forge_graphs"``: the graphs alone.
"""

from __future__ import annotations

LOG_NAME = "forge"
GRAPHS_ARTIFACT = "forge_graphs"


def register() -> None:
    """Idempotent; the ``torch.backends`` entry point, and called again by ``import forge_compile``."""
    from torch._logging._internal import log_registry, register_artifact, register_log

    if LOG_NAME not in log_registry.log_alias_to_log_qnames:
        register_log(LOG_NAME, "forge_compile")
    if GRAPHS_ARTIFACT not in log_registry.artifact_names:
        register_artifact(GRAPHS_ARTIFACT, "forge's post-grad graphs before and after its rewrite")
