"""Fleet coordination: at most ``max_unavailable`` replicas restart at a time.

``base.py`` the :class:`Coordinator` protocol; ``none.py`` one replica (no coordination);
``etcd.py`` etcd v3 leases; ``kubernetes.py`` coordination.k8s.io/v1 Leases; ``gate.py`` the
small object the tick loop asks before a restart; ``setup.py`` the settings group.
"""
