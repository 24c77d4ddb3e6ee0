"""agentd: the node agent (config, daemon, datastore, routing, tunnels, CNI, API, CLI, lab)."""

import os

# grpc (under aetcd) installs fork handlers that can crash a child between fork and exec,
# and the agent forks to start its data-plane worker and other tools.  We never use grpc in
# a forked child, so turn them off before grpc is first imported.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
