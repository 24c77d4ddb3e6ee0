"""``python -m agentd.dataplane udp|ipip --tun NAME --mtu N --local-ip A --control PATH``"""

import sys

from agentd.dataplane.worker import main

sys.exit(main())
