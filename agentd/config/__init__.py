"""agentd's configuration: ``settings`` (the sections, sources and validation: ``load_config``,
``AgentConfig``) and ``values`` (the value kinds and parsers each key uses)."""
