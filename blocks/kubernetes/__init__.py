"""Serve on Kubernetes (``KubernetesCluster``): ``cluster`` is the block; ``api`` the client; ``manifests`` the
objects of a service (pure); ``rollout`` reads a rollout's state; ``secrets`` the store credentials the pods use;
``check`` is what ``gpuferry check`` asks.
"""
