"""The datastore: cluster config, node registrations and subnet leases in etcd.

``store.Datastore`` is the agent's facade over the parts: ``connection`` (client, retries,
failover), ``liveness`` (the etcd lease and its keepalive), ``registration`` (cluster config,
node records), ``leases`` (subnet leases) and ``watches`` (watch streams with resume);
``records`` is what is kept in etcd (pure values and keys), ``subnets`` the etcd transactions
behind subnet allocation, ``etcd`` the thin layer over aetcd (endpoints, TLS, errors).
"""
