"""Flow visibility: every connection the node's pods make or receive and every packet dropped,
as flow records taken from the kernel (conntrack events, NFLOG), like Cilium's Hubble.

``model`` (records and filters, pure), ``ring`` (the bounded ring, followers, the drop
limiter, pure), ``recorder`` (the sockets and the kernel settings: events in, records out),
``views`` (GET /flows, metrics).  What an address or a drop prefix means comes from the
daemon (the policy and services agents), through :class:`recorder.Directory`.
"""
