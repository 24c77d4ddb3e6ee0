"""The kernel side of the agent: rtnetlink, the route programmer, interface facts, namespaces."""
