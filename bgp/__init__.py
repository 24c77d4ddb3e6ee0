"""agentd's BGP-4 speaker: sans-IO sessions and FSM, RIB, best path, route reflection.

Knows nothing of Linux, etcd or the agent.  ``Speaker`` is the sans-IO core, and this
package's namespace is sans-IO only: importing ``bgp`` opens no socket and imports no asyncio
transport.  The transports are their own modules: ``bgp.transport.SpeakerService`` runs a
Speaker on asyncio, ``bgp.bfd_transport.BfdService`` runs BFD (RFC 5881) sessions;
``BfdSession`` is BFD's sans-IO core; ``bgp.testing`` wires speakers together in memory.
"""

from .bestpath import Reason, rank, select
from .bfd import BfdSession, BfdSettings, BfdStateChanged
from .fsm import TRANSITIONS, Event, IllegalTransition, State, transition
from .negotiation import Negotiated
from .peer import Admission, Peer
from .rib import AdjRibIn, BestPathChange, Path, Rib, Source
from .session import Session
from .settings import ListenRange, LocalSettings, PeerSettings
from .speaker import Origination, Speaker
from .views import PeerView, RibPathView

__all__ = [
    "Admission",
    "AdjRibIn",
    "BestPathChange",
    "BfdSession",
    "BfdSettings",
    "BfdStateChanged",
    "Event",
    "IllegalTransition",
    "ListenRange",
    "LocalSettings",
    "Negotiated",
    "Origination",
    "Path",
    "Peer",
    "PeerSettings",
    "PeerView",
    "Reason",
    "RibPathView",
    "Rib",
    "Session",
    "Source",
    "Speaker",
    "State",
    "TRANSITIONS",
    "rank",
    "select",
    "transition",
]
