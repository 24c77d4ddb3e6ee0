"""The Ingress controller: Kubernetes Ingress rules served by a HAProxy on every node (docs/ingress.md)."""
