"""The daemon shell: ``agent`` (``agentd run``: start-up, wiring, shutdown), ``speaker``
(``agentd speaker``), ``api`` (REST + metrics) and ``bgp_json`` (the speaker's views as JSON),
``mesh`` (which BGP peers a node has), ``supervisor`` (restarting long-running tasks) and
``sdnotify`` (systemd's notify protocol)."""
