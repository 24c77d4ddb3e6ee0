"""The Ingress controller: Kubernetes Ingress rules served by a HAProxy on every node (docs/ingress.md).

This package's ``__init__`` stays light: the agent imports the controller's modules only when
``[ingress] enabled`` (off by default), and an agent with it off needs no more than
:func:`remove_ingress_proxy` here."""

from __future__ import annotations

import os
from pathlib import Path

STATE_SUBDIR = "ingress"  # the proxy's files: [agent] state_dir/ingress


def remove_ingress_proxy(state_dir: str | os.PathLike) -> bool:
    """Stop the proxy a previous agent left running and remove its files (True if there was
    one).  The controller's modules are loaded only when there is something to remove."""
    if not (Path(state_dir) / STATE_SUBDIR).exists():
        return False
    from .controller import remove_ingress_proxy as remove

    return remove(Path(state_dir))
