"""Kubernetes-style resources kept in etcd: the kinds, their validation, manifests and the store.

``kinds`` is the table of kinds (Namespace, NetworkPolicy, Pod, Service, EndpointSlice,
Ingress, IngressClass, Secret, ConfigMap), ``validation`` the API server's field rules, ``manifests`` YAML/JSON in and out,
``store`` the etcd keys with apply/get/delete/label and the watch every agent follows,
``cli`` the ``agentd apply|get|delete|label`` commands.

The package imports nothing heavy itself: agentd-cni uses ``kinds`` and ``validation``
without loading the etcd client.
"""

from .kinds import KINDS, Kind, lookup, validate
from .validation import Invalid

__all__ = ["KINDS", "Invalid", "Kind", "lookup", "validate"]
