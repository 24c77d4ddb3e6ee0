"""CNI: ``plugin`` is the ``agentd-cni`` executable (CNI spec 1.0.0); ``netconf`` the subnet
file, conflist and delegate configuration the agent writes for it; ``endpoints`` the files the
plugin leaves for the agent (one per attached pod), which the agent reads."""
