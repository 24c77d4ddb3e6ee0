"""User-space data plane: flannel-UDP and RFC 2003 IPIP over a TUN device with offloads.

The fast path runs in its own worker process (``python -m agentd.dataplane``); the agent
starts it with :class:`DataplaneProcess` and drives it with :class:`DataplaneClient`.
"""

from agentd.dataplane.control import DEFAULT_CONTROL, DataplaneClient, DataplaneError, DataplaneProcess

__all__ = ["DEFAULT_CONTROL", "DataplaneClient", "DataplaneError", "DataplaneProcess"]
